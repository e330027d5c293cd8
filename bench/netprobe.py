"""Link figures between two hosts: TCP round-trip time and bulk throughput each way.

Used by ``bench/bench_multihost.sh`` inside its network namespaces::

    python bench/netprobe.py serve HOST:PORT            # on the far host (exits after one probe)
    python bench/netprobe.py probe HOST:PORT --mb 4     # prints one JSON line

The prober sends ``--mb`` MB and reads ``--mb`` MB back (the far side sends them after
the upload), timing each direction from its own end, and times 20 one-byte round trips.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import time


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError("peer closed early")
        buf += chunk
    return bytes(buf)


def serve(address: str) -> None:
    """Answer one probe: echo pings, sink the upload, then send the download."""
    host, port = address.rsplit(":", 1)
    srv = socket.create_server((host, int(port)))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pings, nbytes = struct.unpack("!IQ", _recv_exact(conn, 12))
    for _ in range(pings):
        conn.sendall(_recv_exact(conn, 1))
    got = 0
    while got < nbytes:
        data = conn.recv(1 << 20)
        if not data:
            raise ConnectionError("upload cut")
        got += len(data)
    conn.sendall(b"k")
    conn.sendall(b"x" * nbytes)
    conn.close()
    srv.close()


def probe(address: str, mb: float, pings: int = 20) -> dict:
    """RTT (median ms) and throughput (Mbit/s) up and down to a ``serve`` peer."""
    host, port = address.rsplit(":", 1)
    deadline = time.time() + 30
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=30)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nbytes = int(mb * 1e6)
    sock.sendall(struct.pack("!IQ", pings, nbytes))
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        sock.sendall(b"p")
        _recv_exact(sock, 1)
        rtts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sock.sendall(b"x" * nbytes)
    _recv_exact(sock, 1)  # the far side has everything
    up_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _recv_exact(sock, nbytes)
    down_s = time.perf_counter() - t0
    sock.close()
    return {"rtt_ms": round(1e3 * statistics.median(rtts), 3), "up_mbit_s": round(8 * nbytes / up_s / 1e6, 1),
            "down_mbit_s": round(8 * nbytes / down_s / 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("serve", "probe"))
    p.add_argument("address")
    p.add_argument("--mb", type=float, default=4.0, help="MB to send each way")
    args = p.parse_args()
    if args.mode == "serve":
        serve(args.address)
    else:
        print(json.dumps(probe(args.address, args.mb)))


if __name__ == "__main__":
    main()
