"""Start swarm members by hand in tests, the way ``shoal launch`` starts them.

A member (``python -m shoal.runtime.processes.cli ROLE ...``) is forked from this pytest process's
warm fork server (:mod:`shoal.runtime.processes.forkserver`), which imported torch once for the
whole session, instead of a fresh interpreter that imports it again (seconds of CPU
each). It is still its own OS process in its own session, with its output in its log;
the handle works like :class:`subprocess.Popen`. ``SHOAL_FORK_SERVER=0`` spawns instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shoal.runtime.processes.forkserver import get_fork_server, spawn_member


def member_env(**extra: str) -> dict[str, str]:
    """The environment launch gives its members: one torch thread, unbuffered output, plus ``extra``."""
    return dict(os.environ, OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def start_member(args: list[str], log: str | Path, env: dict[str, str]):
    """Start ``shoal.runtime.processes.cli ARGS`` with stdout and stderr appended to ``log``; a Popen-like handle."""
    return spawn_member(list(args), log, env)


def run_cli(args: list[str], env: dict[str, str], timeout: float,
            module: str = "shoal.cli") -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, module, *args], capture_output=True, text=True)``, forked.

    The command runs in a child of the session's fork server (its own process and session),
    with stdout and stderr in two files read back as text; spawned instead when the fork
    server is off or does not fit ``env``. On timeout the child is killed and
    :class:`subprocess.TimeoutExpired` raised, as ``subprocess.run`` does.
    """
    argv = [sys.executable, "-m", module, *args]
    server = get_fork_server(env)
    if server is None:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            p = server.spawn(list(args), out.fileno(), env, module=module, err_fd=err.fileno())
        except OSError:
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, rc, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))
