"""Listen vs advertise addresses: a wildcard listen needs --advertise, and with it a run completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from shoal.errors import ShoalError
from shoal.net.channel import advertised_address, check_listen, split_address
from shoal.net.tls import make_keys
from tests.helpers.members import start_member


def test_check_listen_refuses_a_wildcard_without_advertise():
    check_listen("127.0.0.1:0", None)
    check_listen("10.1.2.3:7070", None)
    check_listen("0.0.0.0:7070", "203.0.113.7:7070")
    check_listen("[::]:7070", "[2001:db8::1]:7070")
    for listen in ("0.0.0.0:7070", "[::]:7070", ":7070"):
        with pytest.raises(ShoalError, match="--advertise HOST:7070") as err:
            check_listen(listen, None)
        assert "\n" not in str(err.value)
    with pytest.raises(ShoalError, match="--advertise HOST:PORT"):
        check_listen("0.0.0.0:0", None)
    with pytest.raises(ShoalError, match="must name this machine"):
        check_listen("0.0.0.0:7070", "0.0.0.0:7070")
    with pytest.raises(ShoalError, match="not HOST or HOST:PORT"):
        check_listen("0.0.0.0:7070", "host:notaport")
    with pytest.raises(ShoalError, match="not HOST:PORT"):
        check_listen("0.0.0.0", None)
    with pytest.raises(ShoalError, match="not HOST:PORT"):
        split_address("somehost")


def test_advertised_address():
    assert advertised_address("127.0.0.1:0", None, 41000) == "127.0.0.1:41000"
    assert advertised_address("0.0.0.0:7070", "203.0.113.7:7070", 7070) == "203.0.113.7:7070"
    # behind a port forward: the advertised port is what peers dial
    assert advertised_address("0.0.0.0:7070", "203.0.113.7:17070", 7070) == "203.0.113.7:17070"
    assert advertised_address("0.0.0.0:0", "10.0.0.5", 41234) == "10.0.0.5:41234"
    assert advertised_address("0.0.0.0:0", "10.0.0.5:0", 41234) == "10.0.0.5:41234"
    assert advertised_address("[::]:0", "[2001:db8::1]", 5000) == "[2001:db8::1]:5000"
    assert advertised_address("[::]:0", "[2001:db8::1]:6000", 5000) == "[2001:db8::1]:6000"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shoal.runtime.processes.cli", *args]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1", SHOAL_TOKEN="addr-test-token",
                PYTHONUNBUFFERED="1")


@pytest.mark.integration
@pytest.mark.timeout(400)  # two interpreter start-ups; generous for a loaded 2-core box
def test_wildcard_listen_without_advertise_is_refused_by_the_cli():
    for role in (["coordinator"], ["server", "--join", "127.0.0.1:7070"]):
        proc = subprocess.run(_cli(*role, "--listen", "0.0.0.0:0"), capture_output=True, text=True,
                              timeout=180, env=_env())
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --listen 0.0.0.0:0"), proc.stderr
        assert "--advertise HOST:PORT" in lines[0]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_run_with_wildcard_listen_and_advertise_completes(tmp_path):
    """Roles started by hand as docs/real-machines.md says, all listening on 0.0.0.0."""
    out, addr_file = tmp_path / "run", tmp_path / "coord.address"
    run = ["--model", "tiny", "--stages", "2", "--steps", "2", "--micro-batches", "2", "--micro-batch-size",
           "1", "--seq-len", "16", "--data", "synthetic", "--warmup", "1", "--chunk-mb", "0.01"]
    procs: list[subprocess.Popen] = []
    # Listening on every interface is not loopback: plain text is refused there, so TLS.
    env = dict(_env(), SHOAL_TLS_DIR=str(make_keys(tmp_path / "keys")))

    def start(args: list[str], name: str) -> subprocess.Popen:
        p = start_member(args, tmp_path / f"{name}.log", env)  # forked from the session's warm process
        procs.append(p)
        return p

    try:
        coord = start(["coordinator", "--listen", "0.0.0.0:0", "--advertise", "127.0.0.1", "--min-workers", "2",
                       "--out", str(out), "--address-file", str(addr_file), *run], "coordinator")
        deadline = time.time() + 120
        while not addr_file.exists():
            assert coord.poll() is None, (tmp_path / "coordinator.log").read_text()[-2000:]
            assert time.time() < deadline, "coordinator did not start"
            time.sleep(0.1)
        address = addr_file.read_text().strip()
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        for i in range(2):
            start(["server", "--join", address, "--listen", "0.0.0.0:0", "--advertise", "127.0.0.1",
                   "--ckpt-dir", str(tmp_path / "ckpt"), "--name", f"s{i}"], f"server{i}")
        for i in range(2):
            start(["worker", "--join", address, "--name", f"w{i}"], f"worker{i}")
        coord.wait(timeout=240)
        assert coord.returncode == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 2
        for i in range(2):
            log = (tmp_path / f"server{i}.log").read_text()
            assert " at 127.0.0.1:" in log and "0.0.0.0" not in log.split(" at ", 1)[1].splitlines()[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
