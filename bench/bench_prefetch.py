"""Leases asked ahead: ``launch`` on an emulated scenario with and without worker prefetch.

    OMP_NUM_THREADS=1 SHOAL_TORCH_THREADS=1 .venv/bin/python bench/bench_prefetch.py \
        [--scenario demo] [--steps 10] [--repeat 2] [--sync-every H]

Each repeat runs the same swarm (every worker device of the scenario, its emulated links and
speeds, bench_runtime's tiny workload; exact sync, or local mode with ``--sync-every H``)
twice, with workers asking for
their next task while they compute (``--prefetch``) and without (the default), back to back so
that the load of a shared box hits both. Prints the mean and median step after the first two
(weights pulled, graphs built) and the ratio of the two mean steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import RUN  # noqa: E402


def run(scenario: str, steps: int, prefetch: bool, sync: dict) -> tuple[float, float]:
    """(mean, median) step seconds after the first two of one ``launch`` on ``scenario``."""
    from shoal.plan.scenario import load_scenario
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    n = len(load_scenario(scenario).workers)
    with tempfile.TemporaryDirectory(prefix="shoal-prefetch-") as tmp:
        out = Path(tmp) / "run"
        launch(LaunchConfig(out=str(out), scenario=scenario, steps=steps, timeout_s=900,
                            worker_args=[["--prefetch"]] * n if prefetch else [], **RUN, **sync))
        times = [r["step_time_s"] for r in read_jsonl(out / "metrics.jsonl") if r["step"] >= 2]
    return statistics.fmean(times), statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="demo", help="scenario name or file (its worker devices all run)")
    ap.add_argument("--steps", type=int, default=10, help="steps per run (the first two are not counted)")
    ap.add_argument("--repeat", type=int, default=2, help="pairs of runs")
    ap.add_argument("--sync-every", type=int, default=0, help="local mode with this H (0: exact sync)")
    args = ap.parse_args(argv)
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (the first two are not counted)")
    sync = dict(sync="local", sync_every=args.sync_every) if args.sync_every else {}
    rows = []
    for rep in range(args.repeat):
        on = run(args.scenario, args.steps, True, sync)
        off = run(args.scenario, args.steps, False, sync)
        rows.append((rep + 1, on, off))
        print(f"pair {rep + 1}: ahead {on[0] * 1e3:.0f} ms, not ahead {off[0] * 1e3:.0f} ms", file=sys.stderr,
              flush=True)
    mode = f"local H={args.sync_every}" if args.sync_every else "exact sync"
    print(f"\nleases asked ahead, scenario {args.scenario}, {mode}, {RUN['model']} M={RUN['micro_batches']} "
          f"B={RUN['micro_batch_size']} T={RUN['seq_len']}, {args.steps} steps, {os.cpu_count()} cores\n")
    print("| pair | --prefetch: mean / median step | default: mean / median step | mean step, prefetch / none |")
    print("|---|---|---|---|")
    for rep, on, off in rows:
        print(f"| {rep} | {on[0] * 1e3:.0f} / {on[1] * 1e3:.0f} ms | {off[0] * 1e3:.0f} / {off[1] * 1e3:.0f} ms | "
              f"{on[0] / off[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
