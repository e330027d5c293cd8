"""Threads that compute with torch do so on the process's intra-op thread count.

``torch.set_num_threads(n)`` sets the calling thread's OpenMP and oneMKL thread counts; a thread
started later keeps the libraries' defaults (all the cores, unless ``OMP_NUM_THREADS`` is set
before torch loads) until it sets them itself. oneMKL's matrix products split their sums by
thread count, so the same product computed in such a thread can differ in the last bits from
one computed in the thread that called ``set_num_threads``, and from one run to the next: on the
2-core box a (64 x 4096) @ (4096 x 64) product in a fresh thread differed from the main thread's
in 20 of 20 tries, 0 of 20 once the thread set its count (2026-12-06). ``shoal train --local``
computes micro-batches in threads and a runtime member computes, recomputes, sums and measures
in its event loop's executor, so without this an exact run equals ``train --local`` only where
``OMP_NUM_THREADS=1`` was set before Python started (``shoal launch`` sets it for its members; a
user's shell and a member started by hand do not). Every thread pool of shoal that runs torch
work comes from :func:`compute_pool`, and runtime members' event loops use one as their default
executor (:func:`use_compute_executor`).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import torch


def pin_torch_threads() -> None:
    """Give the calling thread the process's intra-op thread count (``torch.get_num_threads()``,
    as the process's entry point set it), for OpenMP and oneMKL alike."""
    torch.set_num_threads(torch.get_num_threads())


def compute_pool(max_workers: int | None = None, thread_name_prefix: str = "shoal") -> ThreadPoolExecutor:
    """A thread pool whose threads compute on the process's intra-op thread count
    (:func:`pin_torch_threads` as each thread starts). ``max_workers`` None: asyncio's default
    executor's size, ``min(32, cores + 4)``."""
    if max_workers is None:
        max_workers = min(32, (os.cpu_count() or 1) + 4)
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix,
                              initializer=pin_torch_threads)


def use_compute_executor() -> None:
    """Make a :func:`compute_pool` the running loop's default executor, the one
    ``run_in_executor(None, ...)`` uses."""
    asyncio.get_running_loop().set_default_executor(compute_pool(thread_name_prefix="shoal-executor"))
