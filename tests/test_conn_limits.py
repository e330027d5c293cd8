"""Connection limits of shoal's gRPC servers under a file-descriptor limit of 1024 (issue 24).

A peer that never authenticates (a bare TCP connection, a TLS handshake left half-way, a
finished TLS handshake without HTTP/2) is closed ``HANDSHAKE_TIMEOUT_S`` after its accept;
a connection that carries no call is closed after ``IDLE_CLOSE_S``; and a server holds at
most ``connection_cap(fd limit)`` connections, so a flood never takes the descriptors its
files need. The pure rules are tested directly; a real server process with ``ulimit -n
1024`` under 1 800 hostile connections (short limits, so the test waits seconds); and a real
run whose members start with ``ulimit -n 1024``, attacked once step 1 is committed.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from shoal.net.channel import HANDSHAKE_TIMEOUT_S, IDLE_CLOSE_S, connection_cap, server_options
from shoal.train.metrics import read_jsonl

FD_LIMIT = 1024
# A TLS record header and the start of a ClientHello: a handshake that never goes on.
PARTIAL_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"
# The HTTP/2 client preface and an empty SETTINGS frame: a connection ready for calls, none made.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


# ---------------------------------------------------------------------------- the rules

def test_connection_cap_leaves_descriptors_for_files():
    assert connection_cap(1024) == 768  # 256 descriptors stay for files, channels, pipes
    assert connection_cap(20000) == 15000
    assert connection_cap(256) == 128 and connection_cap(100) == 16  # never below 16
    assert connection_cap(resource.RLIM_INFINITY) is None and connection_cap(2**40) is None


def test_server_options_carry_the_limits():
    opts = dict(server_options(fd_limit=FD_LIMIT))
    assert opts["grpc.server_handshake_timeout_ms"] == int(HANDSHAKE_TIMEOUT_S * 1000) == 20000
    assert opts["grpc.max_connection_idle_ms"] == int(IDLE_CLOSE_S * 1000) == 60000
    assert opts["grpc.max_allowed_incoming_connections"] == 768
    assert opts["grpc.so_reuseport"] == 0
    short = dict(server_options(fd_limit=FD_LIMIT, handshake_timeout_s=2.5, idle_close_s=4))
    assert short["grpc.server_handshake_timeout_ms"] == 2500 and short["grpc.max_connection_idle_ms"] == 4000
    assert "grpc.max_allowed_incoming_connections" not in dict(server_options(fd_limit=resource.RLIM_INFINITY))
    # the process's own soft limit when none is given
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert dict(server_options()).get("grpc.max_allowed_incoming_connections") == connection_cap(soft)


# ---------------------------------------------------------------------------- helpers

def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


class _FdPeak:
    """Samples the descriptor count of some processes until stopped; keeps each one's peak."""

    def __init__(self, pids: list[int]):
        self.peak = {pid: _fds(pid) for pid in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            for pid in self.peak:
                self.peak[pid] = max(self.peak[pid], _fds(pid))
            time.sleep(0.01)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def _tls_context(tls_dir: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    ctx.load_cert_chain(str(tls_dir / "member.pem"), str(tls_dir / "member.key"))
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _attack(addr: str, *, idle: int, slow: int, tls_dir: Path | None = None, tls_only: int = 0,
            h2_idle: int = 0) -> tuple[list[socket.socket], int]:
    """Open hostile connections to ``addr`` and keep them; returns them and how many TLS
    handshakes finished. First (with the run's own certificate) ``tls_only`` finished
    handshakes that never speak HTTP/2 and ``h2_idle`` HTTP/2 connections that never make a
    call; then ``idle`` bare TCP connections and ``slow`` TLS handshakes stopped after a few
    bytes. A connection the server refuses at once (it is at its cap) is kept too."""
    host, port = addr.rsplit(":", 1)
    socks, finished = [], 0
    if tls_dir is not None:
        ctx = _tls_context(tls_dir)
        for i in range(tls_only + h2_idle):
            try:
                s = ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10),
                                    server_hostname="localhost")
                if i >= tls_only:
                    s.sendall(H2_PREFACE)
                socks.append(s)
                finished += 1
            except OSError:
                pass
    for i in range(idle + slow):
        s = socket.socket()
        s.settimeout(10)
        try:
            s.connect((host, int(port)))
            if i >= idle:
                s.send(PARTIAL_HELLO)
        except OSError:
            pass  # refused or reset on accept (the server is at its cap): that is allowed
        socks.append(s)
    return socks, finished


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the server has closed ``s``: what it sent (a TLS alert, HTTP/2 frames) is read
    and dropped; end of stream or a reset means closed."""
    s.setblocking(False)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (BlockingIOError, ssl.SSLWantReadError):
        return False
    except OSError:
        return True


# ---------------------------------------------------------------------------- a real server

TOKEN_VALUE, SECRET = "fd-token", b"fd-secret"


def _serve_limited(addr_file: str, tls_dir: str, handshake_s: float, idle_s: float) -> None:
    """The server process: ``ulimit -n 1024``, then the size test's stage servicer behind the
    real interceptor with the given connection limits, on TLS."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    from test_size_limits import SIZES, _Stage

    from shoal.net import shoal_pb2_grpc as pbg
    from shoal.net.auth import run_public_key
    from shoal.net.channel import bind, make_server
    from shoal.net.tls import load_tls

    async def main():
        server = make_server(TOKEN_VALUE, run_key=lambda: run_public_key(SECRET), resolve=SIZES.__getitem__,
                             handshake_timeout_s=handshake_s, idle_close_s=idle_s)
        pbg.add_StageServerServicer_to_server(_Stage(), server)
        port = bind(server, "127.0.0.1:0", load_tls(tls_dir))
        await server.start()
        # written whole under another name, then renamed: the test polls for the file and must
        # never read it half-written (a CI run read it empty)
        Path(addr_file + ".tmp").write_text(f"127.0.0.1:{port}")
        os.replace(addr_file + ".tmp", addr_file)
        await server.wait_for_termination()

    asyncio.run(main())


async def _lease(channel) -> grpc.StatusCode:
    from shoal.net import shoal_pb2 as pb
    from shoal.net import shoal_pb2_grpc as pbg

    try:
        await pbg.StageServerStub(channel).Lease(pb.LeaseRequest(worker="w1"), timeout=60)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_hostile_connections_are_closed_and_descriptors_come_back(tmp_path):
    """A server with ``ulimit -n 1024`` (handshake limit 3 s, idle limit 6 s): 1 500 bare TCP
    connections, 200 half-way TLS handshakes, 30 finished handshakes without HTTP/2 and 30
    HTTP/2 connections without a call. Its descriptors never reach the limit (at most the
    cap, 768, above its own), a member connected before the flood is served during it, the
    server closes every hostile connection, its descriptor count comes back to where it was,
    and a new member connects afterwards."""
    from shoal.net.auth import Identity
    from shoal.net.channel import open_channel
    from shoal.net.tls import load_tls, make_keys

    tls_dir = make_keys(tmp_path / "tls")
    tls = load_tls(str(tls_dir))
    addr_file = tmp_path / "addr"
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tests).parent), tests,
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", "from test_conn_limits import _serve_limited; "
                             f"_serve_limited({str(addr_file)!r}, {str(tls_dir)!r}, 3.0, 6.0)"],
                            env=env, start_new_session=True)
    ident = Identity.joined(TOKEN_VALUE, SECRET, "w1", "worker")
    socks: list[socket.socket] = []
    try:
        deadline = time.time() + 120
        while not addr_file.exists():
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        addr = addr_file.read_text()

        async def member_during_flood():
            async with open_channel(addr, TOKEN_VALUE, identity=ident, tls=tls) as ch:
                first = await _lease(ch)  # connected before the flood
                base = _fds(proc.pid)
                peak = _FdPeak([proc.pid])
                opened, finished = await asyncio.to_thread(_attack, addr, idle=1500, slow=200, tls_dir=tls_dir,
                                                           tls_only=30, h2_idle=30)
                socks.extend(opened)
                during = await _lease(ch)  # the member's connection is in use: never idle-closed
                return first, during, base, peak, finished

        first, during, base, peak, finished = asyncio.run(member_during_flood())
        assert (first, during) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
        assert finished == 60  # the certificate holder's connections were all set up
        # every hostile connection is closed by the server: state, with a generous deadline
        deadline = time.time() + 120
        while not all(_closed_by_peer(s) for s in socks):
            assert time.time() < deadline, f"{sum(not _closed_by_peer(s) for s in socks)} hostile connections open"
            time.sleep(0.5)
        top = peak.stop()[proc.pid]
        print(f"server descriptors: {base} before, peak {top} under {len(socks)} hostile connections")
        assert top < FD_LIMIT, f"the server reached its descriptor limit ({top})"
        assert top <= base + connection_cap(FD_LIMIT) + 8, top
        deadline = time.time() + 60
        while _fds(proc.pid) > base + 2:  # the member's channel is closed: back to the start
            assert time.time() < deadline, f"descriptors stay at {_fds(proc.pid)} (before: {base})"
            time.sleep(0.2)

        async def member_after():
            async with open_channel(addr, TOKEN_VALUE, identity=ident, tls=tls) as ch:
                return await _lease(ch)

        assert asyncio.run(member_after()) == grpc.StatusCode.OK
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------------------- a real run

@pytest.mark.integration
@pytest.mark.timeout(900)
def test_run_under_fd_limit_1024_survives_a_connection_flood(tmp_path, tmp_path_factory):
    """Every member starts with ``ulimit -n 1024`` (soft); once step 1 is committed, 1 500 bare
    TCP connections and 200 half-way TLS handshakes go to the coordinator and to the first
    stage server. Neither reaches its descriptor limit, every step still checkpoints (a write
    needs descriptors), and the run ends with the failure-free run's weights and losses."""
    import json

    from swarm_reference import assert_equal_weights, failure_free_weights, launch_config

    from shoal.runtime.processes.launch import Swarm, _free_port

    ref_weights = failure_free_weights(tmp_path_factory)
    ref_summary = json.loads((Path(tmp_path_factory.getbasetemp()) / "failure_free" / "run" /
                              "summary.json").read_text())
    out = tmp_path / "run"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    socks: list[socket.socket] = []
    with Swarm(launch_config(out, fork_server=False, worker_args=[["--slow", "0.1"]] * 2)) as sw:
        sw.server_ports = [_free_port(), _free_port()]  # known addresses to flood
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))  # inherited by every member spawned now
        try:
            sw.start()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        targets = {sw.coord.pid: sw.address, sw.servers[0].pid: f"127.0.0.1:{sw.server_ports[0]}"}
        for p in [sw.coord, *sw.servers, *sw.workers]:
            assert resource.prlimit(p.pid, resource.RLIMIT_NOFILE)[0] == FD_LIMIT
        deadline = time.time() + 400
        while sw.committed_steps() < 2:
            assert sw.coord.poll() is None, "the coordinator exited early"
            assert time.time() < deadline, "fewer than 2 steps after 400 s"
            time.sleep(0.05)
        peak = _FdPeak(list(targets))
        try:
            for addr in targets.values():
                socks += _attack(addr, idle=1500, slow=200)[0]
            summary = sw.wait()
        finally:
            top = peak.stop()
            for s in socks:
                s.close()
    print(f"descriptor peaks under the flood: {top}; attacked {targets}")
    assert all(n < FD_LIMIT for n in top.values()), top
    assert summary["steps"] == ref_summary["steps"] and summary["losses"] == ref_summary["losses"]
    assert_equal_weights(out, ref_weights)
    # The end needed no new connection to the flooded server (one would wait for the flood's
    # connections to time out): each server sent its final weights on its own connection.
    done = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "done"]
    assert done[0]["final_weights"] == {"sent": 2, "pulled": 0}, done
