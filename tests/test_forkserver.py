"""The member fork server (shoal.runtime.processes.forkserver): forked members are real processes in
their own sessions, with their own log, environment and working folder; kill -9 and exit
statuses read as with subprocess.Popen; off or unusable, members are spawned."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest

from shoal.errors import ShoalError
from shoal.runtime.processes.forkserver import (
    ForkServer,
    Member,
    fork_server_enabled,
    get_fork_server,
)
from tests.helpers.members import member_env, run_cli, start_member


def test_fork_server_switch():
    assert fork_server_enabled({})
    assert fork_server_enabled({"SHOAL_FORK_SERVER": "1"})
    for off in ("0", "false", "No", " off "):
        assert not fork_server_enabled({"SHOAL_FORK_SERVER": off})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    return int(status.split("PPid:")[1].split()[0])


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.integration
@pytest.mark.timeout(300)  # the fork server imports torch once (slow on a loaded box)
def test_forked_members_are_real_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a forked member works in its owner's current folder, as a spawned one
    env = member_env(SHOAL_TOKEN="fork-test-token")
    env.pop("SHOAL_TLS_DIR", None)
    dead = f"127.0.0.1:{_free_port()}"  # nobody listens: the worker keeps retrying its join
    w = start_member(["worker", "--join", dead, "--insecure", "--join-timeout", "120", "--name", "wf"],
                     tmp_path / "w.log", env)
    assert isinstance(w, Member), get_fork_server(env) and get_fork_server(env).broken
    server = get_fork_server(env)
    assert w.pid != os.getpid() and _ppid(w.pid) == server.proc.pid  # forked by the warm parent
    assert os.getsid(w.pid) == w.pid  # its own session (a terminal's signals do not reach it)
    assert os.readlink(f"/proc/{w.pid}/cwd") == str(tmp_path)
    with open(f"/proc/{w.pid}/cmdline", "rb") as f:  # ps shows the member's command, not the server's
        cmd = f.read().rstrip(b"\0").split(b"\0")
    assert cmd[1:] == [b"-m", b"shoal.runtime.processes.cli", b"worker", b"--join", dead.encode(), b"--insecure",
                       b"--join-timeout", b"120", b"--name", b"wf"]
    # The warm parent stays single-threaded, so every later fork is as clean as this one.
    assert _threads(server.proc.pid) == 1
    assert w.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        w.wait(timeout=0.2)
    os.kill(w.pid, signal.SIGKILL)
    assert w.wait(timeout=60) == -signal.SIGKILL and w.poll() == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(w.pid, 0)  # reaped
    w.kill()  # an ended member is not signalled again (as Popen)

    t = start_member(["worker", "--join", dead, "--insecure", "--join-timeout", "120"], tmp_path / "t.log", env)
    t.terminate()
    assert t.wait(timeout=60) == -signal.SIGTERM

    # Its own environment: without a token the member stops with the one-line error, exit 2.
    no_token = {k: v for k, v in env.items() if k != "SHOAL_TOKEN"}
    e = start_member(["worker", "--join", dead, "--insecure"], tmp_path / "e.log", no_token)
    assert isinstance(e, Member)
    assert e.wait(timeout=120) == 2
    assert "error: no join token" in (tmp_path / "e.log").read_text()
    # A usage error exits through argparse's SystemExit(2), as a spawned interpreter would.
    u = start_member(["worker", "--no-such-flag"], tmp_path / "u.log", env)
    assert u.wait(timeout=120) == 2 and "required: --join" in (tmp_path / "u.log").read_text()
    assert _threads(server.proc.pid) == 1

    # A `shoal` command forked with stdout and stderr apart, as subprocess.run(capture_output=True).
    r = run_cli(["plan", "--scenario", str(tmp_path / "missing.json")], env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    r = run_cli(["plan", "--scenario", "demo"], env, timeout=120)
    assert r.returncode == 0 and r.stderr == "" and r.stdout.strip(), r.stderr


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_members_are_spawned_when_the_fork_server_is_off_or_does_not_fit(tmp_path):
    env = member_env(SHOAL_FORK_SERVER="0")
    p = start_member(["worker", "--no-such-flag"], tmp_path / "off.log", env)
    assert isinstance(p, subprocess.Popen)
    assert p.wait(timeout=200) == 2 and "required: --join" in (tmp_path / "off.log").read_text()
    # Another PYTHONPATH than the warm parent imported from: its modules may differ, so spawn.
    get_fork_server(member_env())  # starts this session's server if no test has yet
    other = member_env(PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert get_fork_server(other) is None
    q = start_member(["worker", "--no-such-flag"], tmp_path / "other.log", other)
    assert isinstance(q, subprocess.Popen)
    assert q.wait(timeout=200) == 2


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_warm_parent_with_a_thread_is_refused(tmp_path):
    """OpenBLAS with two threads starts a pool thread when numpy is imported: a fork would
    lose it, so the owner refuses that server (and spawn_member spawns instead)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("OpenBLAS starts no pool thread on one core")
    env = dict(member_env(), OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2")
    server = ForkServer(env)
    try:
        with open(tmp_path / "x.log", "ab") as log, pytest.raises(OSError, match="not single-threaded"):
            server.spawn(["worker", "--help"], log.fileno(), env)
        assert "'threads': 2" in server.broken
    finally:
        server.close()
    assert server.proc.poll() is not None  # closing the control socket ends it


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_ctrl_c_just_after_a_member_forks_leaves_no_member_behind(tmp_path, monkeypatch):
    """Ctrl-C lands when the fork server has forked the coordinator but the swarm holds no
    handle to it yet (where a `shoal demo` interrupted during its start can be): the interrupt
    still unwinds the run, and the swarm's stop kills that member too."""
    import shoal.runtime.processes.forkserver as fs
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    real, forked = fs.spawn_member, []

    def spawn_then_ctrl_c(*args, **kw):
        p = real(*args, **kw)
        forked.append(p.pid)
        os.kill(os.getpid(), signal.SIGINT)  # the member runs; its handle is not yet returned
        return p

    monkeypatch.setattr(fs, "spawn_member", spawn_then_ctrl_c)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # as `shoal demo` sets it
    try:
        cfg = LaunchConfig(out=str(tmp_path / "run"), model="tiny", steps=2, micro_batches=2,
                           micro_batch_size=2, seq_len=32, stages=1, workers=1, timeout_s=60)
        with pytest.raises(KeyboardInterrupt), Swarm(cfg) as sw:
            sw.start()
        assert forked and not _alive(forked[0]), "the coordinator outlived the interrupted swarm"
        with pytest.raises(ShoalError, match="this swarm has stopped"):
            sw.start_worker(0)  # a churn thread's late start: refused, nothing left running
        assert len(forked) == 1
    finally:
        signal.signal(signal.SIGINT, old)
        for pid in forked:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
