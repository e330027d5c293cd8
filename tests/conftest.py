"""Shared test set-up: one torch thread per process (CI has 2 cores), and one tokenizer cache
per pytest run (shared by its xdist processes)."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")
# Members the tests start by hand (coordinator and servers) share the operator's server token.
os.environ.setdefault("SHOAL_SERVER_TOKEN", "test-server-token")

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _session_tokenizer_cache(tmp_path_factory):
    """Every test and every process it starts shares one tokenizer cache, the folder that
    ``tests/test_data.py`` and ``tests/test_train.py`` use: the default corpus is tokenized
    once per session (about 15 CPU-s a vocabulary), not once there and again in
    ``~/.cache/shoal``; and no test depends on what a developer's cache holds. An explicit
    ``$SHOAL_CACHE_DIR`` wins."""
    if os.environ.get("SHOAL_CACHE_DIR"):
        yield
        return
    base = tmp_path_factory.getbasetemp()
    # Under xdist each test process has its own base folder inside the run's: the cache goes
    # one level up, shared (its files are written under a temporary name and renamed).
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shoal-cache"
    d.mkdir(exist_ok=True)
    os.environ["SHOAL_CACHE_DIR"] = str(d)
    try:
        yield
    finally:
        os.environ.pop("SHOAL_CACHE_DIR", None)
