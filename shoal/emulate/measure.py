"""Measure an emulated link over loopback: one-way latency and bulk throughput.

Used by the link-emulation tests and by ``python -m shoal.emulate.measure``, which
prints a table of settings against measurements (recorded in ``docs/emulation.md``).
"""

from __future__ import annotations

import argparse
import socket
import socketserver
import statistics
import threading
import time

from shoal.emulate.links import LinkShaper


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _Sink(socketserver.BaseRequestHandler):
    """Reads until EOF, records (time, cumulative bytes) per recv, then closes."""

    def handle(self) -> None:
        marks = []
        total = 0
        while data := self.request.recv(65536):
            total += len(data)
            marks.append((time.monotonic(), total))
        self.server.marks.append(marks)  # type: ignore[attr-defined]


class _Source(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"x" * self.server.nbytes)  # type: ignore[attr-defined]


def serve(handler: type[socketserver.BaseRequestHandler], **attrs) -> tuple[socketserver.ThreadingTCPServer, str]:
    """A threaded TCP server on a free loopback port; returns it and its address."""
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    for k, v in attrs.items():
        setattr(srv, k, v)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    host, port = srv.server_address[:2]
    return srv, f"{host}:{port}"


def connect(address: str) -> socket.socket:
    """A TCP_NODELAY client socket to ``host:port``."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def measure_latency(latency_s: float, pings: int = 11, size: int = 64,
                    rate: float | None = None) -> float:
    """Median one-way latency (half the echo round trip) through a relay set to ``latency_s``."""
    srv, addr = serve(_Echo)
    try:
        with LinkShaper(up=rate, down=rate) as sh:
            s = connect(sh.proxy_for(addr, latency_s=latency_s))
            rtts = []
            msg = b"p" * size
            for _ in range(pings):
                t0 = time.monotonic()
                s.sendall(msg)
                got = 0
                while got < size:
                    chunk = s.recv(65536)
                    if not chunk:
                        raise ConnectionError("relay closed during a ping")
                    got += len(chunk)
                rtts.append(time.monotonic() - t0)
            s.close()
        return statistics.median(rtts) / 2
    finally:
        srv.shutdown()
        srv.server_close()


class _Ack(socketserver.BaseRequestHandler):
    """Reads messages of ``server.size`` bytes and answers each with one byte."""

    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        size = self.server.size  # type: ignore[attr-defined]
        got = 0
        while data := self.request.recv(65536):
            got += len(data)
            while got >= size:
                got -= size
                self.request.sendall(b"!")


def measure_message(nbytes: int, latency_s: float, rate: float, repeats: int = 5) -> float:
    """Median time to send ``nbytes`` and get a 1-byte answer through a shaped relay.

    The cost model's figure for this is ``2 * latency + nbytes / rate`` (the message
    crosses the uplink bucket, then the answer comes back after one more latency).
    """
    srv, addr = serve(_Ack, size=nbytes)
    try:
        with LinkShaper(up=rate, down=rate) as sh:
            s = connect(sh.proxy_for(addr, latency_s=latency_s))
            times = []
            msg = b"m" * nbytes
            for _ in range(repeats):
                time.sleep(0.05)  # let the buckets go idle, as between tasks
                t0 = time.monotonic()
                s.sendall(msg)
                if s.recv(1) != b"!":
                    raise ConnectionError("relay closed during a message")
                times.append(time.monotonic() - t0)
            s.close()
        return statistics.median(times)
    finally:
        srv.shutdown()
        srv.server_close()


def measure_pacing(target_s: float, compute_s: float, repeats: int = 5) -> float:
    """Median wall time of a task of ``compute_s`` real work padded to ``target_s``."""
    from shoal.emulate.pacing import ComputePacer

    pacer = ComputePacer(device_flops=1.0)
    out = []
    for _ in range(repeats):
        t0 = time.monotonic()
        while time.monotonic() - t0 < compute_s:  # busy "compute"
            pass
        pacer.pad(target_s, time.monotonic() - t0)
        out.append(time.monotonic() - t0)
    return statistics.median(out)


def _rate(marks: list[tuple[float, int]]) -> float:
    """Bytes/s between the first and the last recv: excludes the latency before the first."""
    (t0, b0), (t1, b1) = marks[0], marks[-1]
    return (b1 - b0) / (t1 - t0)


def measure_throughput(rate: float, nbytes: int, direction: str = "up",
                       latency_s: float = 0.02, books: dict | None = None) -> tuple[float, int]:
    """Bulk rate in bytes/s through a relay whose ``direction`` bucket is ``rate``.

    ``direction="up"``: the local side sends ``nbytes`` to a sink (uplink bucket);
    ``"down"``: a source sends ``nbytes`` to the local side (downlink bucket). Returns
    the rate seen by the receiver (wall clock: a loaded host lowers it) and the number of
    bytes it received; ``books``, if given, gets the relay's own accounting
    (``LinkShaper.books()``: busy and idle time of each direction, load-independent).
    """
    if direction == "up":
        srv, addr = serve(_Sink, marks=[])
        shaper = LinkShaper(up=rate, down=None)
    elif direction == "down":
        srv, addr = serve(_Source, nbytes=nbytes)
        shaper = LinkShaper(up=None, down=rate)
    else:
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    try:
        with shaper as sh:
            s = connect(sh.proxy_for(addr, latency_s=latency_s))
            if direction == "up":
                s.sendall(b"y" * nbytes)
                s.shutdown(socket.SHUT_WR)
                s.recv(1)  # returns when the sink has read everything and closed
                deadline = time.monotonic() + 10
                while not srv.marks and time.monotonic() < deadline:  # type: ignore[attr-defined]
                    time.sleep(0.01)
                marks = srv.marks[0]  # type: ignore[attr-defined]
            else:
                marks, total = [], 0
                while data := s.recv(65536):
                    total += len(data)
                    marks.append((time.monotonic(), total))
            s.close()
            if books is not None:
                books.update(sh.books())
        return _rate(marks), marks[-1][1]
    finally:
        srv.shutdown()
        srv.server_close()


def main(argv: list[str] | None = None) -> int:
    """Print measured vs set latency and throughput for a few settings."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latencies-ms", default="5,20,50,150", help="one-way latencies to test")
    ap.add_argument("--rates-mbs", default="0.5,2,8", help="rates in MB/s to test")
    ap.add_argument("--seconds", type=float, default=1.5, help="length of each bulk transfer")
    a = ap.parse_args(argv)
    print("| setting | set | measured | error |")
    print("|---|---|---|---|")
    for ms in (float(x) for x in a.latencies_ms.split(",")):
        got = measure_latency(ms / 1e3) * 1e3
        print(f"| one-way latency | {ms:.0f} ms | {got:.1f} ms | {100 * (got - ms) / ms:+.1f} % |")
    for mbs in (float(x) for x in a.rates_mbs.split(",")):
        for direction in ("up", "down"):
            r, _ = measure_throughput(mbs * 1e6, int(mbs * 1e6 * a.seconds), direction)
            print(f"| {direction}link rate | {mbs:g} MB/s | {r / 1e6:.3f} MB/s | "
                  f"{100 * (r / 1e6 - mbs) / mbs:+.1f} % |")
    for nbytes, ms, mbs in ((131072, 45, 2.5), (524288, 110, 5.0), (4096, 10, 1.25)):
        want = 2 * ms / 1e3 + nbytes / (mbs * 1e6)
        got = measure_message(nbytes, ms / 1e3, mbs * 1e6)
        print(f"| message {nbytes // 1024} kB + 1 B answer, {ms} ms, {mbs:g} MB/s | {want * 1e3:.1f} ms "
              f"| {got * 1e3:.1f} ms | {100 * (got - want) / want:+.1f} % |")
    for target, compute in ((0.020, 0.005), (0.200, 0.050)):
        got = measure_pacing(target, compute)
        print(f"| paced task, {compute * 1e3:.0f} ms compute | {target * 1e3:.0f} ms | {got * 1e3:.1f} ms "
              f"| {100 * (got - target) / target:+.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
