"""Process-wide memory settings of shoal's own processes (the ``shoal`` command and the runtime's
members), applied once at start by their entry points, never on import.

glibc serves an allocation above its mmap threshold (128 KiB at first; it rises as such blocks
are freed) with fresh pages from the kernel, and trims free memory at the heap's top back to the
kernel beyond twice that, so a process that makes and frees message buffers of a few MB (every
pull, push and relay of a runtime member: the payload's bytes, the decoded array, the serialised
reply) faults each one in afresh, a page fault per 4 KiB: decoding a 1 MB frame
(``np.frombuffer(frame.data).copy()``) took 0.74-0.80 ms on the 2-core box, 0.04 ms with the
settings below (bench/results/stream.md, 2026-12-04). :func:`tune_malloc` keeps blocks up to
:data:`MMAP_THRESHOLD` in the heap and up to :data:`TRIM_THRESHOLD` of free memory at its top
for reuse. Larger blocks (a big stage's whole weights) keep glibc's default, so a process's
resident memory grows by at most about the trim threshold. ``SHOAL_MALLOC=system`` keeps the
C library's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

MMAP_THRESHOLD = 32 << 20  # blocks up to this come from the heap (reused), not fresh pages each time
TRIM_THRESHOLD = 128 << 20  # free memory at the heap's top kept for reuse before it goes back to the system
TOP_PAD = 16 << 20  # extra the heap grows by at once (fewer system calls)
ENV = "SHOAL_MALLOC"  # "system": leave the C library's allocator settings alone

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
_DONE: list[bool] = []


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once (OSError where it cannot be)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def release_free() -> bool:
    """Give the free memory of every malloc arena back to the system now (glibc's
    ``malloc_trim(0)``; elsewhere nothing): whether it ran. With blocks up to
    :data:`MMAP_THRESHOLD` kept in the heap, a phase that made and dropped copies of a stage on
    several threads (the screen's reference gradient, a round's merge) leaves them free but
    resident in those threads' arenas, where the next phase's allocations on other threads do
    not reuse them: a stage server's peak grew by those copies. Costs a pass over the arenas'
    free chunks (milliseconds), once a phase."""
    if os.environ.get(ENV, "") == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def tune_malloc() -> bool:
    """Apply the settings above to this process (glibc on Linux; elsewhere, or with
    ``SHOAL_MALLOC=system``, nothing); whether they are in force. Idempotent."""
    if _DONE:
        return _DONE[0]
    ok = False
    if os.environ.get(ENV, "") != "system" and sys.platform.startswith("linux"):
        try:
            mallopt = _libc().mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = all([mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD), mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                      mallopt(_M_TOP_PAD, TOP_PAD)])
        except (OSError, AttributeError):  # not glibc (musl has no mallopt): its defaults stay
            ok = False
    _DONE.append(ok)
    return ok
