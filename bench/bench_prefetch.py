"""Leases asked ahead: ``launch`` on an emulated scenario with and without worker prefetch.

    OMP_NUM_THREADS=1 SHOAL_TORCH_THREADS=1 .venv/bin/python bench/bench_prefetch.py \
        [--scenario demo | --loopback S] [--steps 10] [--repeat 2] [--sync-every H]

Each repeat runs the same swarm (every worker device of the scenario, its emulated links and
speeds, or with ``--loopback S`` bench_runtime's swarm: S stages, a worker each, on loopback;
bench_runtime's tiny workload; exact sync, or local mode with ``--sync-every H``)
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


def run(scenario: str | None, steps: int, prefetch: bool, sync: dict, loopback: int = 0,
        trace: Path | None = None) -> tuple[float, float]:
    """(mean, median) step seconds after the first two of one ``launch`` on ``scenario``, or
    (``scenario`` None) of ``loopback`` stages with a worker each on loopback; ``trace``: its
    members' ``SHOAL_TRACE`` folder (for ``bench/trace_step.py``)."""
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        os.environ["SHOAL_TRACE"] = str(trace)
    from shoal.plan.scenario import load_scenario
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    n = len(load_scenario(scenario).workers) if scenario else loopback
    swarm = dict(scenario=scenario) if scenario else dict(stages=loopback, workers=loopback)
    with tempfile.TemporaryDirectory(prefix="shoal-prefetch-") as tmp:
        out = Path(tmp) / "run"
        try:
            launch(LaunchConfig(out=str(out), steps=steps, timeout_s=900,
                                worker_args=[["--prefetch"]] * n if prefetch else [], **swarm, **RUN, **sync))
        finally:
            os.environ.pop("SHOAL_TRACE", None)  # (the next run traces into its own folder, or not at all)
        times = [r["step_time_s"] for r in read_jsonl(out / "metrics.jsonl") if r["step"] >= 2]
    return statistics.fmean(times), statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="demo", help="scenario name or file (its worker devices all run)")
    ap.add_argument("--steps", type=int, default=10, help="steps per run (the first two are not counted)")
    ap.add_argument("--repeat", type=int, default=2, help="pairs of runs")
    ap.add_argument("--loopback", type=int, default=0, metavar="S",
                    help="instead of a scenario: S stages, a worker each, on loopback (bench_runtime's swarm)")
    ap.add_argument("--sync-every", type=int, default=0, help="local mode with this H (0: exact sync)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="trace each run's members into DIR/prefetch-K and DIR/default-K "
                         "(then: bench/trace_step.py DIR/prefetch-1 --workers)")
    args = ap.parse_args(argv)
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (the first two are not counted)")
    if args.loopback < 0:
        raise SystemExit("--loopback must be a number of stages (at least 1)")
    scenario = None if args.loopback else args.scenario
    sync = dict(sync="local", sync_every=args.sync_every) if args.sync_every else {}
    rows = []
    for rep in range(args.repeat):
        trace = Path(args.trace) if args.trace else None
        on = run(scenario, args.steps, True, sync, args.loopback, trace and trace / f"prefetch-{rep + 1}")
        off = run(scenario, args.steps, False, sync, args.loopback, trace and trace / f"default-{rep + 1}")
        rows.append((rep + 1, on, off))
        print(f"pair {rep + 1}: ahead {on[0] * 1e3:.0f} ms, not ahead {off[0] * 1e3:.0f} ms", file=sys.stderr,
              flush=True)
    mode = f"local H={args.sync_every}" if args.sync_every else "exact sync"
    where = f"scenario {scenario}" if scenario else f"loopback S={args.loopback} W={args.loopback}"
    print(f"\nleases asked ahead, {where}, {mode}, {RUN['model']} M={RUN['micro_batches']} "
          f"B={RUN['micro_batch_size']} T={RUN['seq_len']}, {args.steps} steps, {os.cpu_count()} cores\n")
    print("| pair | --prefetch: mean / median step | default: mean / median step | mean step, prefetch / none |")
    print("|---|---|---|---|")
    for rep, on, off in rows:
        print(f"| {rep} | {on[0] * 1e3:.0f} / {on[1] * 1e3:.0f} ms | {off[0] * 1e3:.0f} / {off[1] * 1e3:.0f} ms | "
              f"{on[0] / off[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
