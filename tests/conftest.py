"""Shared test set-up: one torch thread per process (CI has 2 cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
