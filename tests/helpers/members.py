"""Start swarm members by hand in tests, the way ``shoal launch`` starts them.

A member (``python -m shoal.runtime.cli ROLE ...``) is forked from this pytest process's
warm fork server (:mod:`shoal.runtime.forkserver`), which imported torch once for the
whole session, instead of a fresh interpreter that imports it again (seconds of CPU
each). It is still its own OS process in its own session, with its output in its log;
the handle works like :class:`subprocess.Popen`. ``SHOAL_FORK_SERVER=0`` spawns instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from shoal.runtime.forkserver import spawn_member


def member_env(**extra: str) -> dict[str, str]:
    """The environment launch gives its members: one torch thread, unbuffered output, plus ``extra``."""
    return dict(os.environ, OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def start_member(args: list[str], log: str | Path, env: dict[str, str]):
    """Start ``shoal.runtime.cli ARGS`` with stdout and stderr appended to ``log``; a Popen-like handle."""
    return spawn_member(list(args), log, env)
