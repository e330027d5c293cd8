"""Local-update mode in the real runtime: exact sync vs ``--sync local`` at equal tokens.

    PYTHONPATH=. .venv/bin/python bench/bench_local_runtime.py [--steps 24] [--out /tmp/bench_local_runtime]

Runs ``shoal launch`` on loopback (``tiny``, S = 2 stages, W = 4 workers, one torch thread
each) three times with the same data and seed: exact sync, local H = 4 and local H = 8
(outer lr 0.7, momentum 0.9). Prints one table: final loss (mean of the last 3 steps) and
its ratio to exact, training wall time (first step start to last commit), the wall time at
which the run first reached exact's final loss, and bytes per worker per step by traffic
kind (the runtime's byte counters, worker role). Writes ``loss_curves.png`` (loss against
tokens and against wall time) into ``--out``. Every number is from this one run on this
machine: compare rows, not machines.
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


def run(out: Path, steps: int, workers: int, **sync) -> dict:
    """One ``shoal launch``; its per-step records and the summary."""
    from shoal.runtime.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    summary = launch(LaunchConfig(out=str(out), **RUN, steps=steps, stages=2, workers=workers, timeout_s=1800,
                                  dead_after_s=5.0, min_lease_s=2.0, ckpt_every=0, dashboard=None, **sync))
    return {"recs": read_jsonl(out / "metrics.jsonl"), "summary": summary}


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


def plot(results: dict[str, dict], path: Path) -> None:
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
    fig.suptitle("shoal launch, tiny, S=2 W=4, loopback: exact vs local")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps of each run")
    ap.add_argument("--workers", type=int, default=4, help="workers (2 stages)")
    ap.add_argument("--out", default=None, help="folder for the runs and the PNG (default: a temporary one)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_local_runtime_"))
    out.mkdir(parents=True, exist_ok=True)
    setups = {"exact": {}, "local H=4": dict(sync="local", sync_every=4),
              "local H=8": dict(sync="local", sync_every=8)}
    results = {}
    for name, sync in setups.items():
        folder = out / name.replace(" ", "_").replace("=", "")
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run(folder, args.steps, args.workers, **sync)
    exact_final = tail_loss(results["exact"]["recs"])
    print(f"\ntiny, S=2, W={args.workers}, M={RUN['micro_batches']} x {RUN['micro_batch_size']} x {RUN['seq_len']} "
          f"tokens, {args.steps} steps (equal tokens), loopback; loss = mean of the last 3 steps\n")
    head = ("| run | final loss | / exact | train wall s | wall s to exact's final loss | "
            + " | ".join(f"{k} B/worker/step" for k in KINDS) + " | total B/worker/step |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    rows = {}
    for name, res in results.items():
        recs = res["recs"]
        fin = tail_loss(recs)
        wall = wall_curve(recs)[-1]
        reach = time_to_reach(recs, exact_final)
        b = per_worker_step(res["summary"], args.workers, args.steps)
        rows[name] = dict(final=fin, ratio=fin / exact_final, wall=wall, reach=reach, bytes=b)
        print(f"| {name} | {fin:.4f} | {fin / exact_final:.4f} | {wall:.1f} | "
              f"{'-' if reach is None else f'{reach:.1f}'} | "
              + " | ".join(f"{b[k]:,.0f}" for k in KINDS) + f" | {sum(b.values()):,.0f} |")
    png = out / "loss_curves.png"
    plot(results, png)
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
