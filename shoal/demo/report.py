"""The run report: plots, a Markdown summary and a console summary of one run.

Input is a run directory as the runtime writes it:

* ``metrics.jsonl`` and ``events.jsonl`` (format: :mod:`shoal.train.metrics`), and
  optionally ``churn.jsonl`` (the demo's churn driver, same format);
* ``summary.json`` -- the runtime's summary plus what the demo adds. Keys read here
  (all optional):

  ``scenario``, ``model`` (names); ``plan`` (``Plan.to_dict()``);
  ``predicted_step_time_s`` (cost model), ``simulated_step_time_s`` (simulator),
  ``achieved_step_time_s`` (else derived from metrics, see :func:`achieved_step_time`);
  ``bytes`` -- ``{link_class: {"raw": fp32-equivalent bytes, "wire": bytes sent}}``
  (e.g. :meth:`shoal.net.compress.WireCounter.as_dict`); ``failures_survived``,
  ``tasks_requeued`` (or the runtime's ``requeues``), ``workers_joined`` (else counted
  from events); ``sample_text``; ``codecs`` (``{traffic kind: codec}``); ``churn``;
  ``t0_unix`` (run start, to align ``churn.jsonl``); ``sync_choice`` (the demo's: the
  policy and shape that ran, ``ran``, and who chose them, ``by``: auto, hand or flags).

:func:`write_report` writes ``report/`` inside the run directory (or elsewhere):
``loss.png``, ``throughput.png``, ``report.md`` and ``report.json`` (the numbers of
report.md, machine-readable). Everything is computed from plain dicts by pure
functions (:func:`build_report`), so it is testable without a run.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

from shoal.train.metrics import read_jsonl

EVENT_STYLE = {  # event name -> (colour, label) for the throughput plot
    "kill": ("tab:red", "worker killed"),
    "leave": ("tab:orange", "worker left"),
    "join": ("tab:green", "worker joined"),
}


def achieved_step_time(metrics: list[dict]) -> float | None:
    """Mean committed step time, leaving out step 0 (pipeline fill, connection set-up).

    With a single step, that step's time. None without steps.
    """
    times = [m["step_time_s"] for m in sorted(metrics, key=lambda m: m["step"]) if "step_time_s" in m]
    if not times:
        return None
    body = times[1:] if len(times) > 1 else times
    return statistics.fmean(body)


def _is_worker(e: dict) -> bool:
    """Whether an event is about a worker: role "worker", or no role and not a server's
    name (the launcher names servers ``s0``, ``s1``, ... and logs their kills without a role)."""
    role = e.get("role")
    if role is None:
        return not re.fullmatch(r"s\d+", str(e.get("device", "")))
    return role == "worker"


def _is_server(e: dict) -> bool:
    return e.get("role") == "server" or (e.get("role") is None and not _is_worker(e))


def run_start(metrics: list[dict]) -> float:
    """Seconds (on the events' clock) at which step 0 started; 0 without steps."""
    if not metrics:
        return 0.0
    first = min(metrics, key=lambda m: m["step"])
    return first.get("time_s", 0.0) - first.get("step_time_s", 0.0)


def count_events(events: list[dict], metrics: list[dict]) -> dict[str, int]:
    """Workers lost, servers lost, workers joined mid-run and tasks re-queued.

    Workers lost: worker ``kill`` events (the churn driver's SIGKILLs) when there are
    any, else worker ``leave`` events -- the coordinator also logs a ``leave`` for a
    killed worker, so counting both would count one failure twice. Servers lost: kill
    events with ``role == "server"``. Joined: worker ``join`` events after the first
    step started (the joins at start-up are not churn). Re-queued: the sum of ``count``
    (default 1) of ``requeue`` events (per-step ``requeues`` in metrics are added by
  :func:`build_report`). Events without a ``role`` count as workers'.
    """
    start = run_start(metrics)
    kills = sum(1 for e in events if e.get("event") == "kill" and _is_worker(e))
    leaves = sum(1 for e in events if e.get("event") == "leave" and _is_worker(e))
    servers = sum(1 for e in events if e.get("event") == "kill" and _is_server(e))
    joins = sum(1 for e in events if e.get("event") == "join" and _is_worker(e)
                and e.get("time_s", 0.0) > start)
    requeued = sum(int(e.get("count", 1)) for e in events if e.get("event") == "requeue")
    lost = kills or leaves
    return {"workers_lost": lost, "servers_lost": servers, "failures": lost + servers,
            "workers_joined": joins, "tasks_requeued": requeued}


def plan_from_events(events: list[dict]) -> dict:
    """The run's initial plan as the coordinator logged it (first ``replan`` event).

    A fallback for runs whose summary holds no ``plan``: stages with their layers, the
    workers the coordinator assigned and the server ``assign`` events. Empty if the
    events hold no replan with layers.
    """
    first = next((e for e in events if e.get("event") == "replan" and e.get("layers")), None)
    if first is None:
        return {}
    servers = {int(e["stage"]): e.get("device", "?") for e in events
               if e.get("event") == "assign" and e.get("role") == "server" and e.get("stage") is not None}
    assignment = first.get("assignment") or {}
    stages = [{"layers": list(lay), "server": servers.get(i, "?"),
               "workers": sorted(w for w, s in assignment.items() if int(s) == i)}
              for i, lay in enumerate(first["layers"])]
    return {"method": first.get("method", "n/a"), "stages": stages}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def final_loss(metrics: list[dict], last: int = 5) -> float | None:
    """The run's final loss: the last ``val_loss`` if any, else the mean of the last losses."""
    ms = sorted(metrics, key=lambda m: m["step"])
    vals = [m["val_loss"] for m in ms if m.get("val_loss") is not None]
    if vals:
        return vals[-1]
    losses = [m["loss"] for m in ms if "loss" in m]
    return statistics.fmean(losses[-last:]) if losses else None


def build_report(metrics: list[dict], events: list[dict], summary: dict[str, Any]) -> dict[str, Any]:
    """The report's numbers from the run records (pure; ``report.json`` is this dict)."""
    counted = count_events(events, metrics)
    achieved = summary.get("achieved_step_time_s")
    if achieved is None:
        achieved = achieved_step_time(metrics)
    predicted = summary.get("predicted_step_time_s")
    plan = summary.get("plan") or plan_from_events(events)
    if predicted is None:
        predicted = (plan.get("predicted") or {}).get("step_time_s")
    simulated = summary.get("simulated_step_time_s")
    traffic = {}
    for cls, b in sorted((summary.get("bytes") or {}).items()):
        raw, wire = int(b.get("raw", 0)), int(b.get("wire", 0))
        traffic[cls] = {"raw": raw, "wire": wire, "ratio": raw / wire if wire else None}
    tot_raw = sum(t["raw"] for t in traffic.values())
    tot_wire = sum(t["wire"] for t in traffic.values())
    ms = sorted(metrics, key=lambda m: m["step"])
    tps = [m["tokens_per_s"] for m in ms if "tokens_per_s" in m]
    requeued = summary.get("tasks_requeued", summary.get("requeues"))
    if requeued is None and any("requeues" in m for m in ms):
        requeued = sum(int(m.get("requeues", 0)) for m in ms) + counted["tasks_requeued"]
    return {
        "scenario": summary.get("scenario"),
        "model": summary.get("model"),
        "steps": len(ms),
        "first_loss": ms[0]["loss"] if ms else None,
        "final_loss": final_loss(ms),
        "last_loss": ms[-1]["loss"] if ms else None,
        "tokens": sum(int(m.get("tokens", 0)) for m in ms),
        "mean_tokens_per_s": statistics.fmean(tps) if tps else None,
        "wall_s": ms[-1].get("time_s") if ms else None,
        "step_time": {
            "predicted_s": predicted,
            "simulated_s": simulated,
            "achieved_s": achieved,
            "achieved_over_predicted": _ratio(achieved, predicted),
            "achieved_over_simulated": _ratio(achieved, simulated),
            # The cost model's step has no churn: set beside the simulator's without it, where
            # the run had churn (the simulator replays it; a ratio with it would blame the model).
            "simulated_over_predicted": _ratio(summary.get("simulated_no_churn_step_time_s") or simulated, predicted),
            "simulated_no_churn_s": summary.get("simulated_no_churn_step_time_s"),
            "achieved_over_simulated_no_churn": _ratio(achieved, summary.get("simulated_no_churn_step_time_s")),
        },
        "bytes_method": summary.get("bytes_method"),
        "plan": plan,
        "bytes": traffic,
        "bytes_total": {"raw": tot_raw, "wire": tot_wire, "ratio": tot_raw / tot_wire if tot_wire else None},
        "failures_survived": summary.get("failures_survived", counted["failures"]),
        "workers_lost": summary.get("workers_lost", counted["workers_lost"]),
        "workers_joined": summary.get("workers_joined", counted["workers_joined"]),
        "tasks_requeued": requeued if requeued is not None else counted["tasks_requeued"],
        "codecs": summary.get("codecs", {}),
        "churn": summary.get("churn"),
        "sync_choice": summary.get("sync_choice"),
        "sample_text": summary.get("sample_text", ""),
    }


def _fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def _fmt_r(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _fmt_b(n: int) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n:,} ({n / k:.2f} {unit})"
    return f"{n:,}"


def render_markdown(rep: dict[str, Any]) -> str:
    """``report.md`` from :func:`build_report`'s dict."""
    out = [f"# shoal run report: {rep.get('scenario') or 'run'}", ""]
    loss = rep["final_loss"]
    out += [
        f"- model: {rep.get('model') or 'n/a'}; steps: {rep['steps']}; tokens: {rep['tokens']:,}",
        f"- loss: first {_fmt_r(rep['first_loss'])}, final {_fmt_r(loss)}",
        f"- mean tokens/s: {_fmt_r(rep['mean_tokens_per_s'])}",
        f"- churn: {rep['churn'] if rep['churn'] is not None else 'n/a'}",
        "",
        *([f"- the run's final state: [dashboard]({rep['dashboard']}) (a static page of the live dashboard)"]
          if rep.get("dashboard") else []),
        "", "![loss](loss.png)", "", "![throughput](throughput.png)", "",
        "## Plan", "",
    ]
    choice = rep.get("sync_choice") or {}
    if choice.get("ran"):
        out += [f"policy: {choice['ran']}; codecs {choice.get('compression') or 'none'}", ""]
    stages = (rep["plan"] or {}).get("stages") or []
    replicas = (rep["plan"] or {}).get("replicas") or []
    if stages:
        stage_times = (rep["plan"].get("predicted") or {})
        if len(replicas) > 1:  # every replica's stages, numbered as the runtime numbers them
            out += ["| stage | replica (micro-batches) | layers | server | workers | devices |",
                    "|---|---|---|---|---|---|"]
            rows = [(f"{r} ({rp.get('micro_batches', '?')})", s) for r, rp in enumerate(replicas) for s in rp["stages"]]
        else:
            out += ["| stage | layers | server | workers | devices |", "|---|---|---|---|---|"]
            rows = [(None, s) for s in stages]
        for i, (r, s) in enumerate(rows):
            first, last = s["layers"]
            out.append(f"| {i} |{'' if r is None else f' {r} |'} [{first}, {last}) | {s['server']} | "
                       f"{len(s['workers'])} | {', '.join(s['workers'])} |")
        p = rep["plan"]
        out += ["", f"method: {p.get('method', 'n/a')}; micro-batch size {p.get('micro_batch_size', 'n/a')}, "
                f"{p.get('micro_batches', 'n/a')} micro-batches per step"]
        extra = {k: v for k, v in stage_times.items() if k != "step_time_s"}
        if extra:
            out.append("; ".join(f"{k}: {v:.4g}" for k, v in sorted(extra.items()) if isinstance(v, int | float)))
    else:
        out.append("no plan recorded")
    st = rep["step_time"]
    no_churn = st.get("simulated_no_churn_s")
    churned = ", this run's churn replayed" if no_churn is not None and no_churn != st["simulated_s"] else ""
    out += [
        "", "## Step time", "",
        "| source | step time | achieved / source |", "|---|---|---|",
        f"| cost model (predicted, no churn) | {_fmt_s(st['predicted_s'])} | {_fmt_r(st['achieved_over_predicted'])} |",
        f"| simulator{churned} | {_fmt_s(st['simulated_s'])} | {_fmt_r(st['achieved_over_simulated'])} |",
        *([f"| simulator, without the churn | {_fmt_s(st['simulated_no_churn_s'])} | "
           f"{_fmt_r(st['achieved_over_simulated_no_churn'])} |"]
          if st.get("simulated_no_churn_s") is not None and st["simulated_no_churn_s"] != st["simulated_s"] else []),
        f"| achieved (mean, step 0 excluded) | {_fmt_s(st['achieved_s'])} | 1.00 |",
        "", f"simulated / predicted{' (both without the churn)' if churned else ''}: "
        f"{_fmt_r(st['simulated_over_predicted'])}",
        "", "## Bytes on the wire", "",
    ]
    if rep["bytes"]:
        codecs = rep.get("codecs") or {}
        out += ["| link class | codec | raw (fp32) bytes | wire bytes | raw / wire |", "|---|---|---|---|---|"]
        for cls, b in rep["bytes"].items():
            out.append(f"| {cls} | {codecs.get(cls, 'n/a')} | {_fmt_b(b['raw'])} | {_fmt_b(b['wire'])} | "
                       f"{_fmt_r(b['ratio'])} |")
        t = rep["bytes_total"]
        out.append(f"| total | | {_fmt_b(t['raw'])} | {_fmt_b(t['wire'])} | {_fmt_r(t['ratio'])} |")
        if rep.get("bytes_method"):
            out += ["", f"({rep['bytes_method']})"]
    else:
        out.append("not measured")
    out += [
        "", "## Faults", "",
        f"- failures survived: {rep['failures_survived']} (workers lost: {rep['workers_lost']})",
        f"- workers joined mid-run: {rep['workers_joined']}",
        f"- tasks re-queued: {rep['tasks_requeued']}",
        "", "## Sample", "", "```text", (rep.get("sample_text") or "(none)").rstrip(), "```", "",
    ]
    return "\n".join(out)


def plot_loss(metrics: list[dict], path: str | Path) -> None:
    """Loss and validation loss against step, as a PNG."""
    from matplotlib.figure import Figure  # Agg canvas: no display, no global backend state

    ms = sorted(metrics, key=lambda m: m["step"])
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    ax.plot([m["step"] for m in ms], [m["loss"] for m in ms], marker="." if len(ms) < 50 else None,
            label="train loss")
    val = [(m["step"], m["val_loss"]) for m in ms if m.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean cross-entropy, nats)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def plot_throughput(metrics: list[dict], events: list[dict], path: str | Path) -> None:
    """Tokens/s of each step against wall time, with kill/leave/join events as lines.

    Each point is a committed step, at the time it committed. Joins before step 0
    started (the start-up) are not marked.
    """
    from matplotlib.figure import Figure

    ms = sorted(metrics, key=lambda m: m["step"])
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    ax.plot([m.get("time_s", 0.0) for m in ms], [m.get("tokens_per_s", 0.0) for m in ms],
            marker="." if len(ms) < 50 else None, color="tab:blue", label="tokens/s (per step)")
    shown: set[str] = set()
    start = run_start(ms)
    for e in events:
        name = e.get("event")
        if name not in EVENT_STYLE or not _is_worker(e):
            continue
        if name == "join" and e.get("time_s", 0.0) <= start:
            continue  # start-up joins are not churn
        colour, label = EVENT_STYLE[name]
        ax.axvline(e.get("time_s", 0.0), color=colour, linestyle="--", alpha=0.7,
                   label=None if name in shown else label)
        shown.add(name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    ax.set_title("Throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def load_run(run_dir: str | Path) -> tuple[list[dict], list[dict], dict]:
    """``(metrics, events, summary)`` of a run directory (missing files read as empty).

    Events are ``events.jsonl`` plus, when that file holds no ``kill`` events (a
    launcher that does not log its kills), ``churn.jsonl`` (the churn driver's kills
    and joins, see :mod:`shoal.demo.emulated`), sorted by time. A churn record with
    ``unix_time`` is re-timed to the coordinator's clock when ``summary.json`` has
    ``t0_unix`` (the run's start as a Unix time).
    """
    d = Path(run_dir)
    summary_path = d / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    events = read_jsonl(d / "events.jsonl")
    t0 = summary.get("t0_unix")
    # The launcher logs its SIGKILLs in events.jsonl itself; then churn.jsonl repeats
    # them (and the coordinator logs the joins), so it is only read as a fallback.
    logged_kills = any(e.get("event") == "kill" for e in events)
    for rec in [] if logged_kills else read_jsonl(d / "churn.jsonl"):
        if t0 is not None and "unix_time" in rec:
            rec = {**rec, "time_s": round(rec["unix_time"] - t0, 4)}
        events.append(rec)
    events.sort(key=lambda e: e.get("time_s", 0.0))
    return read_jsonl(d / "metrics.jsonl"), events, summary


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``loss.png``, ``throughput.png``, ``report.md`` and ``report.json``; return the folder.

    The folder is ``out_dir`` or ``<run_dir>/report``.
    """
    metrics, events, summary = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    rep = build_report(metrics, events, summary)
    page = Path(run_dir) / "dashboard.html"
    if page.exists():
        rep["dashboard"] = os.path.relpath(page, out)
    plot_loss(metrics, out / "loss.png")
    plot_throughput(metrics, events, out / "throughput.png")
    (out / "report.md").write_text(render_markdown(rep), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return out


def print_summary(rep: dict[str, Any], folder: str | Path | None = None, console=None) -> None:
    """A compact console summary of :func:`build_report`'s dict (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    st = rep["step_time"]
    t = Table(title=f"shoal run: {rep.get('scenario') or 'run'}", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    if (rep.get("sync_choice") or {}).get("ran"):
        t.add_row("policy", rep["sync_choice"]["ran"])
    t.add_row("steps", f"{rep['steps']}  (loss {_fmt_r(rep['first_loss'])} -> {_fmt_r(rep['final_loss'])})")
    t.add_row("tokens/s", _fmt_r(rep["mean_tokens_per_s"]))
    t.add_row("step time", f"predicted {_fmt_s(st['predicted_s'])}, simulated {_fmt_s(st['simulated_s'])}, "
              f"achieved {_fmt_s(st['achieved_s'])}")
    t.add_row("achieved / sim", f"{_fmt_r(st['achieved_over_simulated'])}  "
              f"(/ predicted {_fmt_r(st['achieved_over_predicted'])})")
    bt = rep["bytes_total"]
    if bt["wire"]:
        t.add_row("wire bytes", f"{_fmt_b(bt['wire'])} vs {_fmt_b(bt['raw'])} fp32 ({_fmt_r(bt['ratio'])}x)")
    t.add_row("faults", f"{rep['failures_survived']} failures survived ({rep['workers_lost']} workers lost), "
              f"{rep['workers_joined']} joined, "
              f"{rep['tasks_requeued']} tasks re-queued")
    if rep.get("sample_text"):
        t.add_row("sample", rep["sample_text"].strip().splitlines()[0][:100] if rep["sample_text"].strip() else "")
    if folder is not None:
        t.add_row("report", str(folder))
    console.print(t)


def compare_runs(run_dir: str | Path, baseline_dir: str | Path) -> dict[str, float | None]:
    """Compression measurement: a run against an uncompressed run of the same length.

    Returns the final losses, their relative gap ``(loss - baseline) / baseline`` and
    the wire-byte reduction (baseline wire bytes / run wire bytes, and raw / wire of the
    run itself).
    """
    m, e, s = load_run(run_dir)
    bm, be, bs = load_run(baseline_dir)
    rep, base = build_report(m, e, s), build_report(bm, be, bs)
    loss, bloss = rep["final_loss"], base["final_loss"]
    wire, bwire = rep["bytes_total"]["wire"], base["bytes_total"]["wire"]
    return {
        "final_loss": loss,
        "baseline_final_loss": bloss,
        "loss_gap": (loss - bloss) / bloss if loss is not None and bloss else None,
        "wire_reduction_vs_baseline": bwire / wire if wire and bwire else None,
        "raw_over_wire": rep["bytes_total"]["ratio"],
        "steps": rep["steps"],
        "baseline_steps": base["steps"],
    }
