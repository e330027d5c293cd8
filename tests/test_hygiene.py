"""Process hygiene: SIGTERM/SIGHUP to `shoal launch` stops every member, the run token is
written owner-only, member names are unique, a finished run refuses joiners in one
line, status says `waiting` (and why), stalls are reported, an empty token file is
refused."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shoal.errors import ShoalError
from shoal.net import shoal_pb2 as pb
from shoal.net.channel import load_token
from shoal.runtime.roles.coordinator import Coordinator, unique_name
from shoal.train.metrics import read_jsonl


def _spec(**kw) -> pb.RunSpec:
    base = dict(model="tiny", stages=2, steps=3, micro_batches=2, micro_batch_size=2, seq_len=16, seed=0,
                lr=3e-3, min_lr=3e-4, warmup=1, weight_decay=0.1, grad_clip=1.0, dead_after_s=0.3,
                min_lease_s=1.0, data="synthetic", ordered_grads=True)
    base.update(kw)
    return pb.RunSpec(**base)


class _Refused(Exception):
    pass


class _Context:
    """Stands in for a gRPC servicer context: ``abort`` raises with the code and details."""

    async def abort(self, code, details):
        raise _Refused(f"{code.name}: {details}")


def test_unique_name():
    assert unique_name("w0", {"w1"}) == "w0"
    assert unique_name("w0", {"w0"}) == "w0-2"
    assert unique_name("w0", {"w0", "w0-2"}) == "w0-3"


def test_names_status_waiting_and_finished_run(tmp_path):
    async def main():
        c = Coordinator(_spec(), "tok", min_workers=2, out=str(tmp_path))
        assert c.spec.run_id  # every run gets an id
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"), None)
        w_a = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name="w"), None)).member_id
        st = json.loads((await c.Status(pb.Empty(), None)).json)
        assert st["state"] == "waiting" and not st["ready"]
        assert st["waiting_for"] == ["1 of 2 workers joined"]
        w_b = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name="w"), None)).member_id
        st = json.loads((await c.Status(pb.Empty(), None)).json)
        assert st["state"] == "running" and st["ready"] and st["waiting_for"] == []
        assert sorted(st["workers"]) == ["w", "w-2"]  # two members, two names
        assert c.members[w_b].name == "w-2"
        # a stage loses its only worker: status says waiting, and why
        await c.Leave(pb.MemberRequest(member_id=w_a), None)
        st = json.loads((await c.Status(pb.Empty(), None)).json)
        assert st["state"] == "waiting" and not st["ready"]
        assert len(st["waiting_for"]) == 1 and "have no worker" in st["waiting_for"][0]
        # no commit for long: a stall is reported once (log, event), then the run fails
        c.last_commit_t -= 1000
        c.stall_fail_s = 0
        c._watch()
        c._watch()
        c.stall_fail_s = 500
        c._watch()
        st = json.loads((await c.Status(pb.Empty(), None)).json)
        assert st["state"] == "failed" and "no step committed" in st["error"]
        # joining a finished (here: failed) run is refused in one line
        with pytest.raises(_Refused) as err:
            await c.Join(pb.JoinRequest(role="worker", flops=1e9, name="late"), _Context())
        assert "FAILED_PRECONDITION" in str(err.value) and "start a new run" in str(err.value)
        await asyncio.wait_for(c.finished.wait(), 10)

    asyncio.run(main())
    events = read_jsonl(tmp_path / "events.jsonl")
    stalls = [e for e in events if e["event"] == "stall"]
    assert len(stalls) == 1 and "have no worker" in stalls[0]["why"]
    assert [e["event"] for e in events].count("failed") == 1


def test_empty_token_file_is_refused(tmp_path):
    f = tmp_path / "token"
    f.write_text("  \n")
    with pytest.raises(ShoalError, match="empty"):
        load_token(token_file=str(f))


def test_sighup_is_handled_like_sigterm():
    from shoal.runtime.processes.launch import Stopped, stop_on_signals

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        stop_on_signals()
        with pytest.raises(Stopped, match="SIGHUP"):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _members(marker: str) -> list[int]:
    """Pids of runtime processes whose command line mentions ``marker``."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "shoal.runtime.processes.cli" in cmd and marker in cmd and " launch " not in cmd:
            pids.append(int(d.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_sigterm_to_launch_stops_every_member(tmp_path):
    """SIGTERM to `shoal launch` mid-run: it exits in one line and no member is left."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "shoal.runtime.processes.cli", "launch", "--out", str(out), "--model", "tiny",
           "--stages", "2", "--workers", "2", "--steps", "500", "--micro-batches", "2",
           "--micro-batch-size", "2", "--seq-len", "16", "--data", "synthetic", "--timeout", "250"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines: list[str] = []  # stdout, read as it comes (the token line is printed once all started)
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    join_line = f"--token-file {out / 'token'}"
    try:
        deadline = time.time() + 200
        members: set[int] = set()
        while time.time() < deadline:
            addr = out / "logs" / "coordinator.address"
            if addr.exists():
                members |= set(_members(str(out))) | set(_members(addr.read_text().strip()))
                # coordinator, 2 servers, 2 workers, and launch has said how to add members
                if len(members) >= 5 and any(join_line in ln for ln in lines):
                    break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert len(members) >= 5, members
        assert any(join_line in ln for ln in lines), lines
        token = out / "token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text().strip()
        proc.send_signal(signal.SIGTERM)
        stderr = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2
    assert stderr.strip().splitlines() == ["error: stopped by SIGTERM; every member was stopped"], stderr
    # launch has stopped them; allow the kernel up to 3 s to reap (a wait on state, not a fixed sleep)
    deadline = time.time() + 3
    while any(_alive(p) for p in members) and time.time() < deadline:
        time.sleep(0.05)
    left = [p for p in members if _alive(p)]
    assert not left, f"members still alive: {left}"


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_worker_without_a_coordinator_says_so_in_one_line(tmp_path):
    """A worker whose coordinator is gone (finished run, wrong address): one line, exit 2."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "shoal.runtime.processes.cli", "worker", "--join", f"127.0.0.1:{port}",
                        "--flops", "1e9", "--insecure", "--join-timeout", "2"], capture_output=True, text=True,
                       timeout=200,
                       env=dict(os.environ, SHOAL_TOKEN="t", OMP_NUM_THREADS="1"))
    assert r.returncode == 2
    assert r.stderr.startswith("error: cannot reach the coordinator") and "Traceback" not in r.stderr


def test_bad_join_timeout_is_a_one_line_error(capsys, monkeypatch):
    from shoal.cli import main

    monkeypatch.setenv("SHOAL_TOKEN", "t")
    assert main(["worker", "--join", "127.0.0.1:1", "--flops", "1e9", "--join-timeout", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --join-timeout must be a positive"), err
