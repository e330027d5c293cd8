"""A flapping link: a loopback TCP relay that resets every connection periodically.

``FlapProxy(target, period_s, down_s, for_s)`` listens on 127.0.0.1 and relays each
connection to ``target``. Every ``period_s`` seconds (for ``for_s`` seconds in all) the
link goes down for ``down_s``: open connections are reset (RST, as after a NAT or Wi-Fi
drop) and connections made meanwhile are reset at once. Used to test that runs survive
connections that die under them (``--dial-map`` points a member at the proxy). A proxy made
with ``armed=False`` relays faithfully until :meth:`FlapProxy.arm`, so a test can let its
members join and measure their links first and flap only under the run's steps.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time


def _reset(sock: socket.socket) -> None:
    """Close with RST instead of FIN (linger 0), like a link that dropped."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FlapProxy:
    """A loopback relay to ``target`` ("host:port") whose connections are reset periodically."""

    def __init__(self, target: str, period_s: float = 0.6, down_s: float = 0.1, for_s: float = 20.0,
                 armed: bool = True):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.period_s, self.down_s, self.for_s = period_s, down_s, for_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.down = False
        self.resets = 0  # connections reset so far
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._armed = threading.Event()
        if armed:
            self._armed.set()
        self._threads = [threading.Thread(target=self._accept, daemon=True),
                         threading.Thread(target=self._flap, daemon=True)]

    def start(self) -> FlapProxy:
        for t in self._threads:
            t.start()
        return self

    def arm(self) -> FlapProxy:
        """Start flapping now (for ``for_s`` seconds from here) if made with ``armed=False``."""
        self._armed.set()
        return self

    def close(self) -> None:
        self._stop.set()
        _reset(self.listener)
        with self._lock:
            for c in list(self._conns):
                _reset(c)
            self._conns.clear()

    def __enter__(self) -> FlapProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _flap(self) -> None:
        while not self._armed.wait(0.05):
            if self._stop.is_set():
                return
        end = time.monotonic() + self.for_s
        while not self._stop.is_set() and time.monotonic() < end:
            if self._stop.wait(max(self.period_s - self.down_s, 0.0)):
                return
            self.down = True
            with self._lock:
                for c in list(self._conns):
                    _reset(c)
                    self.resets += 1
                self._conns.clear()
            self._stop.wait(self.down_s)
            self.down = False

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                _reset(client)
                self.resets += 1
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                dead = src in self._conns or dst in self._conns
                self._conns.discard(src)
                self._conns.discard(dst)
            if dead:
                _reset(src)
                _reset(dst)
