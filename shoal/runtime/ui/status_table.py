"""``shoal status``: the dashboard's data (:func:`shoal.runtime.ui.dashboard.snapshot`) as rich tables."""

from __future__ import annotations

from typing import Any


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 7200:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if b < 1000 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1000
    return "-"


def _flops(f: float | None) -> str:
    if not f:
        return "-"
    for v, u in ((1e12, "TF/s"), (1e9, "GF/s"), (1e6, "MF/s")):
        if f >= v:
            return f"{f / v:.1f} {u}"
    return f"{f:.0f} F/s"


def _mbit(bps: float | None) -> str:
    return "-" if bps is None else f"{bps * 8 / 1e6:.0f}"


def _link(link: dict | None) -> str:
    if not link:
        return "not measured"
    region = f"{link['region']} " if link.get("region") else ""
    text = f"{region}up {_mbit(link['up_Bps'])} down {_mbit(link['down_Bps'])} Mbit/s"
    if link.get("measured") and link.get("server"):
        text += (f"; to {link['server']}: rtt {_secs(link['rtt_s'])}, up {_mbit(link['server_up_Bps'])} "
                 f"down {_mbit(link['server_down_Bps'])}")
    elif link.get("latency_s") is not None:
        text += f"; to {link['server']} {_secs(link['latency_s'])}"
    return text


def _waiting(w: dict | None) -> str:
    return f"{w['who']} for {_secs(w['for_s'])}" if w else "-"


def _split(sp: dict | None) -> str:
    if not sp:
        return "-"
    return "+".join(f"{sp[k]:.2f}" for k in ("compute_s", "transfer_s", "sync_s", "waiting_s")) + \
        f"={sp['total_s']:.2f} s"


def summary_line(snap: dict[str, Any]) -> str:
    """One line: state, step, loss, workers, step times."""
    r, t = snap["run"], snap["step_time"]
    state = "done" if r["done"] else "training" if r["ready"] else "waiting for members"
    loss = f"{snap['loss'][-1][1]:.4f}" if snap["loss"] and snap["loss"][-1][1] is not None else "-"
    live = sum(w["state"] != "gone" for w in snap["workers"])
    hot = [s["stage"] for s in snap["stages"] if s["bottleneck"]]
    eta = "" if r["done"] or not r["ready"] else f", ETA {_secs(r.get('eta_s'))}"
    return (f"{state}: model {r['model']}, step {r['committed']}/{r['steps']}{eta}, epoch {r['epoch']}, loss {loss}, "
            f"{live}/{len(snap['workers'])} workers live, re-queued {r['requeues']}, step time predicted "
            f"{_secs(t['predicted_s'])} / achieved {_secs(t['achieved_s'])}, plan {r['plan_method']}"
            + (f", bottleneck stage {hot[0]}" if hot else ""))


def status_tables(status: dict[str, Any], events: int = 12):
    """A rich renderable of a coordinator's status (the ``dashboard`` part of its Status reply)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    snap = status.get("dashboard")
    if not snap:  # a coordinator without the dashboard figures: the plain fields
        t = Table("field", "value", title="shoal status")
        for k, v in sorted(status.items()):
            t.add_row(k, str(v))
        return t
    # Folded, never cut: piped into a file the console is 80 columns wide.
    stages = Table(title="stages (* bottleneck; last step = compute+transfer+sync+waiting)", box=box.SIMPLE)
    for col in ("stage", "layers", "server", "workers", "step", "pool", "wait", "leases", "last step", "waiting for"):
        stages.add_column(col, overflow="fold",
                          justify="right" if col in ("step", "pool", "wait", "leases") else "left")
    for s in snap["stages"]:
        stages.add_row(str(s["stage"]) + (" [bold red]*[/]" if s["bottleneck"] else ""),
                       f"[{s['layers'][0]}, {s['layers'][1]})" if s["layers"] else "?",
                       s["server"] or "(vacant)", ", ".join(s["workers"]) or "-",
                       *("-" if s[k] is None else str(s[k]) for k in ("step", "pool_todo", "pool_waiting", "leases")),
                       _split(s["split"]), _waiting(s.get("waiting_for")))
    # Device and link columns: measured (or emulated) figures; none for members that do not measure.
    shown = any(w.get("link") or w["device"] != "loopback" for w in snap["workers"])
    cols = ["worker", "state", *(["device"] if shown else []), "stage", "speed", "tasks", "mean task",
            "seen", "sent", *(["link"] if shown else [])]
    workers = Table(title="workers", box=box.SIMPLE)
    for col in cols:
        workers.add_column(col, overflow="fold",
                           justify="right" if col in ("stage", "tasks", "mean task", "seen", "sent") else "left")
    colour = {"active": "green", "silent": "yellow", "gone": "red"}
    for w in snap["workers"]:
        state = f"[{colour.get(w['state'], 'white')}]{w['state']}[/]" + (f" ({w['why']})" if w["why"] else "")
        cells = {"worker": w["name"], "state": state, "device": w["device"],
                 "stage": str(w["stage"]) if w["stage"] >= 0 else "-", "speed": _flops(w.get("flops")),
                 "tasks": str(w.get("tasks_done", 0)), "mean task": _secs(w.get("mean_task_s")),
                 "seen": f"{_secs(w['last_seen_s'])} ago", "sent": _bytes(w["bytes"]["wire"]),
                 "link": _link(w.get("link"))}
        workers.add_row(*(cells[c] for c in cols))
    ev = Table(title=f"last {events} events", show_header=False, box=box.SIMPLE)
    ev.add_column(justify="right", no_wrap=True)
    ev.add_column(no_wrap=True)
    ev.add_column(overflow="fold")
    for e in snap["events"][-events:]:
        rest = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "time_s"))
        ev.add_row(f"{e.get('time_s') or 0:.1f} s", e.get("event", "?"), rest)
    return Group(Text(summary_line(snap)), stages, workers, ev)
