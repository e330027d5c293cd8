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


# ---------------------------------------------------------------------- longest tests first
# Two xdist processes share the suite. With tests in file order, a 60 s test that happens to
# come last runs alone while the other process idles; started longest first (and handed out
# one at a time: `--maxschedchunk 1` in pyproject.toml) the short tests fill the end. The
# durations come from a recorded run (tests/durations.json; a test not in it counts as
# short). Re-record after adding a slow test:
#     SHOAL_RECORD_DURATIONS=tests/durations.json .venv/bin/python -m pytest
DURATIONS_FILE = os.path.join(os.path.dirname(__file__), "durations.json")
_recorded: dict[str, float] = {}


def _known_durations() -> dict[str, float]:
    import json

    try:
        with open(DURATIONS_FILE) as f:
            return {str(k): float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError):
        return {}  # no file or a damaged one: file order, as pytest's own


def pytest_collection_modifyitems(config, items):
    """Order the collected tests by their recorded duration, longest first (a stable sort:
    tests of equal or unknown duration keep pytest's order). Every xdist process sorts the
    same collection the same way, as xdist requires."""
    known = _known_durations()
    if known:
        items.sort(key=lambda it: -known.get(it.nodeid, 0.0))


def pytest_runtest_logreport(report):
    """With ``$SHOAL_RECORD_DURATIONS`` set, add up each test's phases (the controlling
    process receives every xdist process's reports)."""
    if os.environ.get("SHOAL_RECORD_DURATIONS"):
        _recorded[report.nodeid] = _recorded.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """With ``$SHOAL_RECORD_DURATIONS`` set, the controlling process writes every test's
    set-up + call + tear-down seconds (tests of 1 s or more) to that file."""
    path = os.environ.get("SHOAL_RECORD_DURATIONS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not _recorded:
        return
    import json

    slow = {k: round(v, 1) for k, v in sorted(_recorded.items(), key=lambda kv: -kv[1]) if v >= 1.0}
    with open(path, "w") as f:
        json.dump(slow, f, indent=0)
        f.write("\n")
