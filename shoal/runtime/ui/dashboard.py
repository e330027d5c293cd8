"""The coordinator's live dashboard: a read-only web page and a JSON API.

:func:`snapshot` turns the coordinator's state into one JSON-able dict: the plan
(stages, layer ranges, servers, workers), every worker and server (device, measured
speed, link, tasks, bytes, last seen, state), every stage (pool, leases, the last
step's time split, the bottleneck), the loss and tokens/s series, predicted vs
achieved step time and the event log. ``shoal status`` prints the same dict as tables
(:mod:`shoal.runtime.ui.status_table`).

:class:`Dashboard` serves it from inside the coordinator's asyncio loop with a small
HTTP/1.1 server (``asyncio.start_server``, no extra dependency; every request is
answered and the connection closed):

* ``GET /`` -- the page (``dashboard_static/``: hand-written HTML, CSS, JS and SVG,
  inlined into one document; no CDN, works offline); it polls the API every second;
* ``GET /api/state`` -- :func:`snapshot` as JSON.

Only GET and HEAD exist (read-only). Bound to a non-loopback address every request
needs the run token, as ``?token=...`` or ``Authorization: Bearer ...``, compared in
constant time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from shoal.errors import ShoalError
from shoal.runtime.ui.stats import (
    achieved_step_time,
    bottleneck,
    eta_seconds,
    member_state,
    stage_waits_for,
)

log = logging.getLogger("shoal.dashboard")

STATIC = Path(__file__).with_name("dashboard_static")
MAX_HEAD = 16 * 1024  # request line + headers larger than this are refused
EVENTS_SHOWN = 200  # newest events in a snapshot


# --------------------------------------------------------------------------- pure helpers


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ShoalError when malformed."""
    host, sep, port = bind.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ShoalError(f"--dashboard {bind!r}: expected HOST:PORT, e.g. 127.0.0.1:8080 (port 0: any free)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``): only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def authorized(token: str, query: str, authorization: str) -> bool:
    """Whether a request carries the run token (``?token=`` or ``Bearer``), in constant time."""
    given = parse_qs(query).get("token", [""])[0]
    if not given and authorization.lower().startswith("bearer "):
        given = authorization[7:].strip()
    return bool(token) and hmac.compare_digest(given.encode(), token.encode())


def finite(x: Any) -> Any:
    """``x`` with every NaN/inf float replaced by None (JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


class EventTail:
    """The records of a growing JSONL file, read incrementally (complete lines only)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.records = path, 0, []

    def read(self) -> list[dict]:
        """All complete records so far."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.records
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
        for line in chunk[:end].splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    self.records.append(rec)
        self.offset += end
        return self.records


# --------------------------------------------------------------------------- the snapshot


def _split(stats) -> dict | None:
    if stats is None or not stats.HasField("last_step"):
        return None
    s = stats.last_step
    return {"step": s.step, "total_s": s.total_s, "compute_s": s.compute_s, "transfer_s": s.transfer_s,
            "sync_s": s.sync_s, "waiting_s": s.waiting_s}


def _bytes(coord, m) -> dict:
    """Bytes the member's process sent, by traffic kind (wire and fp32-equivalent)."""
    _, counts = coord.traffic.get(m.counter_id, ("", []))
    by_kind: dict[str, dict[str, int]] = {}
    for c in counts:
        d = by_kind.setdefault(c.kind, {"wire": 0, "raw": 0, "messages": 0})
        d["wire"] += int(c.wire)
        d["raw"] += int(c.raw)
        d["messages"] += int(c.messages)
    return {"wire": sum(d["wire"] for d in by_kind.values()), "by_kind": by_kind}


def _link(coord, m, stage: int) -> dict | None:
    """The member's emulated device links (to its stage's server host); None on loopback."""
    sc = coord.emulated
    if sc is None or not m.device:
        return None
    try:
        dev = sc.device(m.device)
    except Exception:  # noqa: BLE001 -- an unknown device has no link to show
        return None
    out = {"region": dev.region, "up_Bps": dev.up, "down_Bps": dev.down}
    sid = coord.stage_server[stage] if 0 <= stage < len(coord.stage_server) else ""
    host = coord.plays.get(sid)
    if host:
        with contextlib.suppress(Exception):
            link = sc.network.link(dev, sc.device(host))
            out.update(server=host, latency_s=link.latency, bandwidth_Bps=link.bandwidth)
    return out


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x > 0)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def _measured(coord, m, stage: int) -> tuple[str | None, dict | None]:
    """(device label, link figures) a member of a measured run reported; (None, None) if none.

    The link: the member's own up/down (median over its measured paths, as the planner
    takes it), its region in the newest plan, every measured path (peer, round trip, rate
    each way) and the path to its stage's server."""
    f = getattr(coord, "figures", {}).get(m.member_id)
    if f is None or f.kind == "unmeasured":
        return None, None
    if not f.paths:
        return f.kind, None
    names = coord.names
    planned = getattr(coord, "planned_on", None)
    region = f.region
    if planned is not None:
        with contextlib.suppress(Exception):
            region = planned.device(m.member_id).region
    away = [p for p in f.paths if not p.same_host] or f.paths  # same-host paths skip the access link
    link = {"measured": True, "region": region or "", "up_Bps": f.up or _median([p.up for p in away]),
            "down_Bps": f.down or _median([p.down for p in away]),
            "paths": [{"peer": names.get(p.dst, p.dst), "rtt_s": p.rtt_s, "up_Bps": p.up, "down_Bps": p.down,
                       "same_host": p.same_host} for p in f.paths]}
    sid = coord.stage_server[stage] if 0 <= stage < len(coord.stage_server) else ""
    to = next((p for p in f.paths if p.dst == sid), None)
    if to is not None:
        link.update(server=names.get(sid, sid), rtt_s=to.rtt_s, latency_s=to.rtt_s / 2,
                    server_up_Bps=to.up, server_down_Bps=to.down)
    return f.kind, link


def _events(coord) -> list[dict]:
    """The run's event log: events.jsonl (with the launcher's kills) or the in-memory list."""
    if coord.out is not None:
        tail = coord.__dict__.get("_dashboard_events")
        if tail is None:
            tail = coord._dashboard_events = EventTail(coord.out / "events.jsonl")
        events = list(tail.read())
    else:
        events = list(coord.recent)
    for r in coord.history:
        if r.get("requeues"):
            events.append({"event": "requeue", "time_s": r.get("time_s"), "step": r["step"],
                           "count": r["requeues"]})
    events.sort(key=lambda e: e.get("time_s") or 0.0)
    return events[-EVENTS_SHOWN:]


def snapshot(coord) -> dict:
    """Everything the dashboard shows, from the coordinator's state (JSON-able, no NaN)."""
    spec = coord.spec
    now = time.monotonic()
    dead_after = spec.dead_after_s

    def row(m, present: bool, why: str = "") -> dict:
        st = m.stats
        stage = coord._stage_of(m) if present else (st.stage if st is not None else -1)
        kind, measured = _measured(coord, m, stage)
        r = {"id": m.member_id, "name": m.name, "role": m.role,
             "device": m.device or kind or ("not measured yet" if m.will_measure else "loopback"),
             "state": member_state(present, now - m.last_seen, dead_after),
             "why": (getattr(m, "death", "") or why) if why else "",
             "stage": stage, "last_seen_s": now - m.last_seen, "joined_s": m.joined_s - coord.t0,
             "bytes": _bytes(coord, m)}
        if m.role == "worker":
            done = int(st.tasks_done) if st is not None else 0
            r.update(flops=m.flops, tasks_done=done, tasks_committed=coord.tasks_per_worker.get(m.name, 0),
                     compute_s=st.compute_s if st is not None else 0.0,
                     mean_task_s=st.compute_s / done if st is not None and done else None,
                     link=_link(coord, m, stage) or measured)
        else:
            r.update(address=m.address, link=measured)
        return r

    workers, servers = {}, {}
    # Gone first, so a member that re-joined under the same name shows as its live self.
    for m, why, _ in sorted(coord.gone.values(), key=lambda g: g[2]):
        (workers if m.role == "worker" else servers)[m.name] = row(m, False, why)
    for m in coord.members.values():
        (workers if m.role == "worker" else servers)[m.name] = row(m, True)

    stages = []
    for s in range(spec.stages):
        sid = coord.stage_server[s] if s < len(coord.stage_server) else ""
        srv = coord.members.get(sid)
        st = srv.stats if srv is not None else None
        layers = list(coord.layers[s]) if s < len(coord.layers) else None
        stages.append({
            "stage": s, "layers": layers, "server": srv.name if srv else "", "server_address": srv.address if srv else "",
            "workers": sorted(w["name"] for w in workers.values() if w["state"] != "gone" and w["stage"] == s),
            "step": int(st.step) if st is not None else None,
            "pool_todo": int(st.pool_todo) if st is not None else None,
            "pool_waiting": int(st.pool_waiting) if st is not None else None,
            "leases": int(st.leases) if st is not None else None,
            "server_workers": int(st.workers) if st is not None else None,
            "standbys_logging": list(st.standby_logging) if st is not None else [],
            "standbys_lagging": list(st.standby_lagging) if st is not None else [],
            "split": _split(st), "bottleneck": False,
            "held": [{"worker": getattr(coord, "names", {}).get(h.worker, h.worker), "tasks": int(h.tasks), "oldest_s": h.oldest_s}
                     for h in st.held] if st is not None else [],
            "wait_input": int(st.wait_input) if st is not None else None,
            "wait_grad": int(st.wait_grad) if st is not None else None,
            "unpushed": [getattr(coord, "names", {}).get(w, w) for w in st.unpushed] if st is not None else [],
            "committing": bool(st.committing) if st is not None else False,
            "step_s": st.step_s if st is not None else None})
        stages[-1]["waiting_for"] = (stage_waits_for(stages[-1]) if coord.ready and not coord.done else None)
    b = bottleneck([x["split"] for x in stages])
    if b is not None:
        stages[b]["bottleneck"] = True

    hist = sorted(coord.history, key=lambda r: r["step"])
    plan = coord.plan
    return finite({
        "run": {"model": spec.model, "stages": spec.stages, "steps": spec.steps, "committed": coord.committed,
                "epoch": coord.epoch, "ready": coord.ready, "done": coord.done,
                "micro_batches": spec.micro_batches, "micro_batch_size": spec.micro_batch_size,
                "seq_len": spec.seq_len, "dead_after_s": dead_after, "elapsed_s": time.time() - coord.t0,
                "scenario": coord.emulated.name if coord.emulated is not None else None,
                "plan_method": plan.method if plan is not None else "even split",
                "requeues": coord.total_requeues,
                "eta_s": eta_seconds(spec.steps, coord.committed, [r["step_time_s"] for r in hist]) if coord.ready
                else None},
        "stages": stages,
        "workers": sorted(workers.values(), key=lambda w: _order(w["name"])),
        "servers": sorted(servers.values(), key=lambda w: _order(w["name"])),
        "loss": [[r["step"], r["loss"]] for r in hist],
        "tokens_per_s": [[r["step"], r["tokens_per_s"]] for r in hist],
        "step_time": {"predicted_s": plan.predicted_step_time_s if plan is not None else None,
                      "achieved_s": achieved_step_time([r["step_time_s"] for r in hist]),
                      "last_s": hist[-1]["step_time_s"] if hist else None},
        "events": _events(coord),
    })


def _order(name: str) -> tuple:
    """w2 before w10."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1, name)


# --------------------------------------------------------------------------- the server


def page() -> bytes:
    """The dashboard document: index.html with its CSS and JS inlined (one request, offline)."""
    html = (STATIC / "index.html").read_text()
    html = html.replace("/*STYLE*/", (STATIC / "style.css").read_text())
    html = html.replace("/*APP*/", (STATIC / "app.js").read_text())
    return html.encode()


def static_page(snap: dict) -> bytes:
    """The page with one snapshot built in: it renders that state and never polls, so the
    final state of a run stays viewable from its folder after the coordinator is gone."""
    state = json.dumps(finite(snap), allow_nan=False).replace("</", "<\\/")  # no "</script>" inside
    html = page().decode()
    return html.replace("<script>\n", f"<script>\nwindow.SHOAL_STATE = {state};\n", 1).encode()


def write_page(path: Path, snap: dict) -> Path:
    """Write :func:`static_page` of ``snap`` to ``path`` (atomically); returns ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(static_page(snap))
    tmp.replace(path)
    return path


class Dashboard:
    """The read-only HTTP server of the dashboard, run on the coordinator's event loop."""

    def __init__(self, coord, bind: str, token: str, *, require_token: bool | None = None):
        self.coord, self.token = coord, token
        self.host, self.port = parse_bind(bind)
        # Loopback: only this machine's users can connect, as with the run folder itself.
        self.require_token = (not is_loopback(self.host)) if require_token is None else require_token
        if self.require_token and not token:
            raise ShoalError("a dashboard on a non-loopback address needs a run token (SHOAL_TOKEN)")
        self.page = page()
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def start(self) -> None:
        """Listen (sets ``url``; port 0 picks a free port)."""
        self.server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_HEAD)
        port = self.server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = b""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            status, ctype, body, extra = self.respond(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            status, ctype, body, extra = 400, "text/plain", b"bad request\n", {}
        try:
            method = head.split(b" ", 1)[0]
            lines = [f"HTTP/1.1 {status} {_REASON.get(status, 'Error')}", f"Content-Type: {ctype}",
                     f"Content-Length: {len(body)}", "Cache-Control: no-store", "Connection: close",
                     "X-Content-Type-Options: nosniff", *(f"{k}: {v}" for k, v in extra.items())]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            if method != b"HEAD":
                writer.write(body)
            await asyncio.wait_for(writer.drain(), 10.0)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def respond(self, head: bytes) -> tuple[int, str, bytes, dict]:
        """(status, content type, body, extra headers) for one request head."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return 400, "text/plain", b"bad request\n", {}
        method, target, _ = parts
        headers = {}
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if sep:
                headers[k.strip().lower()] = v.strip()
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"read-only: GET only\n", {"Allow": "GET, HEAD"}
        url = urlsplit(target)
        if self.require_token and not authorized(self.token, url.query, headers.get("authorization", "")):
            return (401, "text/plain", b"this dashboard needs the run token: add ?token=... to the URL\n",
                    {"WWW-Authenticate": "Bearer"})
        if url.path in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", self.page, {}
        if url.path == "/api/state":
            body = json.dumps(snapshot(self.coord), allow_nan=False).encode()
            return 200, "application/json", body, {}
        return 404, "text/plain", b"not found\n", {}


_REASON = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}
