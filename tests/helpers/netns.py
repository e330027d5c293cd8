"""Hosts made of Linux network namespaces, joined by veth links shaped with tc tbf.

Tests that need real links between "machines" (rates, addresses other than loopback)
build them here, as ``bench/bench_multihost.sh`` does: each host is a namespace with its
own address on its loopback device, each pair of hosts a veth link routed by address and
rate-limited both ways. Needs root and iproute2; :func:`netns_available` says whether this
machine can. Everything made (namespaces, links, processes started with :meth:`Hosts.popen`)
is removed on exit.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from pathlib import Path

_COUNTER = itertools.count()


def netns_available() -> str:
    """``""`` when network namespaces can be made here, else why not (for a skip message)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2 (ip, tc)"
    probe = f"shoal-probe-{os.getpid()}-{next(_COUNTER)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def tbf_burst(rate_mbit: float) -> str:
    """A tbf bucket size that lets the shaper reach its rate: 10 ms of traffic, at least 64 KiB."""
    return f"{max(64, int(rate_mbit * 1e6 / 8 / 100 / 1024) + 1)}kb"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Hosts:
    """``with Hosts({"A": "10.77.0.1", ...}, [("A", "B", 400.0), ...]) as h: h.popen("A", argv)``.

    Links are ``(host, host, Mbit/s)`` (None: unshaped); the rate holds each way.
    """

    def __init__(self, hosts: dict[str, str], links: list[tuple[str, str, float | None]]):
        self.ip = dict(hosts)
        tag = f"{os.getpid() % 100000}{next(_COUNTER)}"
        self.ns = {h: f"shoal-{tag}-{h}" for h in hosts}
        self.links = links
        self.tag = tag[-6:]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hosts:
        try:
            for h, ns in self.ns.items():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.ip[h]}/32", "dev", "lo")
            for a, b, rate in self.links:
                da, db = f"v{self.tag}{a}{b}"[:15], f"v{self.tag}{b}{a}"[:15]
                _ip("link", "add", da, "netns", self.ns[a], "type", "veth", "peer", "name", db, "netns", self.ns[b])
                for h, dev, peer in ((a, da, b), (b, db, a)):
                    _ip("-n", self.ns[h], "link", "set", dev, "up")
                    _ip("-n", self.ns[h], "route", "add", f"{self.ip[peer]}/32", "dev", dev, "src", self.ip[h])
                    if rate:
                        subprocess.run(["tc", "-n", self.ns[h], "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                        f"{rate}mbit", "burst", tbf_burst(rate), "latency", "200ms"],
                                       check=True, capture_output=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def popen(self, host: str, argv: list[str], log: str | Path, **kw) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (``ip netns exec``), output appended to ``log``."""
        with open(log, "a") as f:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, host: str, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to completion (output captured as text)."""
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], capture_output=True, text=True,
                              timeout=timeout, **kw)

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
