"""Deferred checks against inline ones: the same ``shoal launch`` twice, the stage servers'
routine recomputations judged beside the steps (the default) or before their push counts.

    PYTHONPATH=. python bench/bench_deferred_checks.py                  # gpt-125m fp32 on the CPU
    PYTHONPATH=. python bench/bench_deferred_checks.py --device cuda --precision bf16 \\
        --micro-batches 8 --micro-batch-size 8 --seq-len 1024            # beside GPU workers

Runs ``shoal launch`` (S stage servers, W workers, loopback, TLS, the default ``--spot-check``)
with ``SHOAL_DEFERRED_CHECKS=0`` (inline: every recomputation before its push counts, as
before deferred checks) and ``=1`` (deferred), alternating ``--repeat`` times, and prints per
run: each step's time, the mean of the middle steps (neither the first, with its start-up, nor
the last, whose pushes are all recomputed inline in both modes), the wall time, the servers'
recomputations (and how many ran beside the steps) and the final loss (equal in both: the
checks change no weight of an honest run).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def one_run(run: dict, out: Path, stages: int, workers: int, timeout_s: float, deferred: bool) -> dict:
    """One launch in the given mode: step times, wall, recomputations, final loss."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.runtime.safety.guard import DEFERRED_ENV
    from shoal.train.metrics import read_jsonl

    os.environ[DEFERRED_ENV] = "1" if deferred else "0"  # the members started by launch inherit it
    t0 = time.monotonic()
    summary = launch(LaunchConfig(out=str(out), stages=stages, workers=workers, timeout_s=timeout_s, **run))
    wall = time.monotonic() - t0
    steps = [r["step_time_s"] for r in sorted(read_jsonl(out / "metrics.jsonl"), key=lambda r: r["step"])]
    logs = "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    lines = re.findall(r"recomputed the push of .*", logs)
    return {"steps": steps, "wall": wall, "checks": len(lines), "beside": sum("beside the steps" in x for x in lines),
            "loss": summary["final_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (every process)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1, help="inline/deferred pairs, alternating which goes first")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds each launch may take")
    ap.add_argument("--out", default=None, help="folder for the runs, kept (default: a temp folder, removed: a "
                                                "gpt-125m run's checkpoints take about 5 GB)")
    args = ap.parse_args()
    run = dict(model=args.model, precision=args.precision, device=args.device, steps=args.steps,
               micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
               seed=0, warmup=2, dead_after_s=120.0, min_lease_s=120.0)
    root = Path(args.out or tempfile.mkdtemp(prefix="shoal-deferred-"))
    print(f"{args.model} {args.precision} on {args.device}, S={args.stages} W={args.workers}, M={args.micro_batches} "
          f"B={args.micro_batch_size} T={args.seq_len}, {args.steps} steps, default --spot-check; {os.cpu_count()} "
          f"CPUs, load {os.getloadavg()[0]:.1f}\n", flush=True)
    print("| pair | checks | step times (s) | middle steps mean (s) | wall (s) | recomputations (beside the steps) "
          "| final loss |")
    print("|---|---|---|---|---|---|---|")
    try:
        for i in range(args.repeat):
            for deferred in ((False, True) if i % 2 == 0 else (True, False)):
                name = "deferred" if deferred else "inline"
                r = one_run(run, root / f"{i}-{name}", args.stages, args.workers, args.timeout, deferred)
                mid = r["steps"][1:-1] or r["steps"]
                print(f"| {i} | {name} | {' '.join(f'{s:.1f}' for s in r['steps'])} | {sum(mid) / len(mid):.2f} "
                      f"| {r['wall']:.0f} | {r['checks']} ({r['beside']}) | {r['loss']:.6f} |", flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
