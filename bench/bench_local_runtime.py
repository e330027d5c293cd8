"""Local-update mode and wire compression in the real runtime, at equal tokens.

    PYTHONPATH=. .venv/bin/python bench/bench_local_runtime.py [--steps 24] [--out DIR] [--runs a,b]
    PYTHONPATH=. .venv/bin/python bench/bench_local_runtime.py --demo [--steps 20] [--out DIR] [--reach-steps N]
        [--bandwidth-scale X]

Loopback (default): ``shoal launch`` (``tiny``, S = 2 stages, W = 4 workers, one torch thread
each), the same data and seed, one run per row of :data:`SETUPS`: exact fp32, exact with int8
for every kind both ways, local H = 4 and H = 8 (the default outer step) uncompressed and
with int8 (and top-k pseudo-gradients); local rows overlap each round's merge with the next
round (delayed application, the default), ``waits`` rows (``--no-overlap``) do not. ``--demo``:
the emulated demo scenario (``shoal demo``'s devices, links and time scale, no churn): exact
fp32 vs local H = 4 (with and without overlap) and H = 8 with int8 -- there links are slow, so
sync traffic costs wall time.

Prints one table: final loss (mean of the last 3 steps) and its ratio to exact, training wall
time (first step start to last commit), the wall time at which the run first reached exact's
final loss (and its fraction of exact's wall time; with ``--reach-steps N`` from a second run
of each row for N steps with its own schedule, since a row a little behind exact at equal
tokens never reaches exact's loss within them), and bytes per worker per step by traffic
kind with the total's ratio to exact fp32 (the runtime's byte counters, worker role: what
workers send and receive). Writes ``loss_curves.png`` (loss against tokens and against wall
time) into ``--out``. Every number is from this one run on this machine: compare rows, not
machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")

RUN = dict(model="tiny", micro_batches=8, micro_batch_size=4, seq_len=64, seed=0, lr=3e-3, warmup=2)
KINDS = ("activations", "activation_grads", "grad_push", "weight_pull", "control")


INT8 = dict(compression="int8")
TOPK = dict(compression="act=int8,grad=int8,push=topk-int8:0.1,pull=int8")
SETUPS = {  # row name -> LaunchConfig fields
    "exact": {},
    "exact int8": INT8,
    "local H=4": dict(sync="local", sync_every=4),
    "local H=8": dict(sync="local", sync_every=8),
    "local H=4 int8": dict(sync="local", sync_every=4, **INT8),
    "local H=4 int8 waits": dict(sync="local", sync_every=4, overlap=False, **INT8),
    "local H=8 int8": dict(sync="local", sync_every=8, **INT8),
    "local H=8 int8+topk": dict(sync="local", sync_every=8, **TOPK),
}
DEMO_SETUPS = ("exact", "local H=4 int8", "local H=4 int8 waits", "local H=8 int8")


def run(out: Path, steps: int, workers: int, **sync) -> dict:
    """One ``shoal launch``; its per-step records and the summary."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    summary = launch(LaunchConfig(out=str(out), **RUN, steps=steps, stages=2, workers=workers, timeout_s=1800,
                                  dead_after_s=5.0, min_lease_s=2.0, ckpt_every=0, dashboard=None, **sync))
    return {"recs": read_jsonl(out / "metrics.jsonl"), "summary": summary, "workers": workers}


def run_demo(out: Path, steps: int, bandwidth_scale: float = 4.0, **sync) -> dict:
    """One ``shoal demo`` run on its emulated scenario (no churn); records and summary."""
    from shoal.demo.cli import DemoConfig
    from shoal.demo.cli import run_demo as demo
    from shoal.train.metrics import read_jsonl

    # each row's policy on the 2 stages of the loopback rows (a row without one is exact), not
    # the policy and shape shoal demo's default --sync auto would choose
    demo(DemoConfig(steps=steps, churn=False, quiet=True, dashboard=None, out=str(out),
                    bandwidth_scale=bandwidth_scale, **{"sync": "exact", "stages": 2, **sync}))
    summary = json.loads((out / "summary.json").read_text())
    workers = len(json.loads((out / "scenario.json").read_text()).get("devices", [])) or 1
    return {"recs": read_jsonl(out / "metrics.jsonl"), "summary": summary, "workers": summary.get("workers", workers)}


def wall_curve(recs: list[dict]) -> list[float]:
    """Seconds from the start of step 0 to each step's commit."""
    t, out = 0.0, []
    for r in recs:
        t += r["step_time_s"]
        out.append(t)
    return out


def tail_loss(recs: list[dict], n: int = 3) -> float:
    """Mean loss of the last ``n`` steps (one step's loss is one batch: noisy)."""
    return statistics.fmean(r["loss"] for r in recs[-n:])


def time_to_reach(recs: list[dict], target: float, n: int = 3) -> float | None:
    """Wall seconds at which the running mean of ``n`` losses first reaches ``target``."""
    walls = wall_curve(recs)
    for i in range(n - 1, len(recs)):
        if statistics.fmean(r["loss"] for r in recs[i - n + 1:i + 1]) <= target:
            return walls[i]
    return None


def per_worker_step(summary: dict, workers: int, steps: int) -> dict[str, float]:
    """Bytes per worker per step by kind, as the workers' byte counters saw them."""
    by = summary.get("bytes_by_role", {}).get("worker", {})
    return {k: by.get(k, {}).get("wire", 0) / workers / steps for k in KINDS}


def worker_count(summary: dict, fallback: int) -> int:
    """Worker processes that took part (tasks per worker in the summary), else ``fallback``."""
    return len(summary.get("tasks_per_worker") or {}) or fallback


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in results.items():
        recs = res["recs"]
        tokens = [sum(r["tokens"] for r in recs[:i + 1]) for i in range(len(recs))]
        a.plot(tokens, [r["loss"] for r in recs], label=name)
        b.plot(wall_curve(recs), [r["loss"] for r in recs], label=name)
    a.set_xlabel("tokens")
    b.set_xlabel("wall seconds (training)")
    for ax in (a, b):
        ax.set_ylabel("loss")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps of each run")
    ap.add_argument("--workers", type=int, default=4, help="workers (2 stages)")
    ap.add_argument("--out", default=None, help="folder for the runs and the PNG (default: a temporary one)")
    ap.add_argument("--runs", default=None, help=f"comma-separated rows (default all): {', '.join(SETUPS)}")
    ap.add_argument("--demo", action="store_true", help="the emulated demo scenario instead of loopback "
                                                        f"(rows {', '.join(DEMO_SETUPS)})")
    ap.add_argument("--bandwidth-scale", type=float, default=4.0,
                    help="--demo: the scenario's bandwidths times this (shoal demo's default 4; 1: as written)")
    ap.add_argument("--reach-steps", type=int, default=0,
                    help="also run every row but exact for this many steps (its own LR schedule) and take the "
                         "wall time to exact's final loss from that run (0: from the equal-token run)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_local_runtime_"))
    out.mkdir(parents=True, exist_ok=True)
    names = args.runs.split(",") if args.runs else list(DEMO_SETUPS if args.demo else SETUPS)
    if "exact" not in names:
        names.insert(0, "exact")  # the reference of every ratio
    def one(name: str, steps: int, tag: str = "") -> dict:
        folder = out / (name.replace(" ", "_").replace("=", "").replace("+", "_") + tag)
        print(f"running {name}{tag} ...", file=sys.stderr, flush=True)
        if args.demo:
            return run_demo(folder, steps, args.bandwidth_scale, **SETUPS[name])
        return run(folder, steps, args.workers, **SETUPS[name])

    results = {name: one(name, args.steps) for name in names}
    # A row whose loss at equal tokens is a little above exact's may never reach exact's final
    # loss within those tokens; run longer (its own schedule) to time when it does.
    longer = {name: one(name, args.reach_steps, f"_{args.reach_steps}steps")
              for name in names if args.reach_steps and name != "exact"}
    exact_final = tail_loss(results["exact"]["recs"])
    exact_wall = wall_curve(results["exact"]["recs"])[-1]
    where = (f"emulated demo scenario (shoal demo's devices, links x{args.bandwidth_scale:g}, no churn)" if args.demo
             else f"tiny, S=2, W={args.workers}, M={RUN['micro_batches']} x {RUN['micro_batch_size']} x "
                  f"{RUN['seq_len']} tokens, loopback")
    print(f"\n{where}, {args.steps} steps (equal tokens); loss = mean of the last 3 steps"
          + (f"; time to exact's final loss from runs of {args.reach_steps} steps (their own schedule)"
             if longer else "") + "\n")
    head = ("| run | final loss | / exact | train wall s | wall s to exact's final loss | / exact wall | "
            + " | ".join(f"{k} B/worker/step" for k in KINDS) + " | total B/worker/step | exact total / total |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    rows = {}
    exact_total = None
    for name, res in results.items():
        recs = res["recs"]
        fin = tail_loss(recs)
        wall = wall_curve(recs)[-1]
        reach = time_to_reach((longer.get(name) or res)["recs"], exact_final)
        b = per_worker_step(res["summary"], worker_count(res["summary"], res["workers"]), len(recs))
        total = sum(b.values())
        exact_total = exact_total or total
        rows[name] = dict(final=fin, ratio=fin / exact_final, wall=wall, reach=reach, bytes=b, total=total,
                          bytes_ratio=exact_total / total if total else None)
        print(f"| {name} | {fin:.4f} | {fin / exact_final:.4f} | {wall:.1f} | "
              f"{'-' if reach is None else f'{reach:.1f}'} | "
              f"{'-' if reach is None else f'{reach / exact_wall:.2f}'} | "
              + " | ".join(f"{b[k]:,.0f}" for k in KINDS) + f" | {total:,.0f} | {exact_total / total:.1f}x |")
    png = out / "loss_curves.png"
    plot(results | {f"{k} ({args.reach_steps} steps)": v for k, v in longer.items()}, png,
         f"{where}: exact vs local / compressed")
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
