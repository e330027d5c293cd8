"""Wall time of ``shoal plan --scenario gaming-world`` as a user runs it, and where it goes.

Each repeat starts a fresh Python process (what a user's shell does), so the figure includes
interpreter start-up and imports. Beside it, in the same run: the bare interpreter start, the
imports of the plan command (``shoal.cli`` building the ``plan`` parser plus ``shoal.plan``),
and the planner alone in-process (``make_plan`` on the loaded scenario, after a warm-up call).
Also checks that the command never imports torch.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_cli_start.py [--scenario gaming-world] [--repeats 5]

Target (issue #11): the command's wall time <= 1 s on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

IMPORTS = "from shoal.cli import build_parser; build_parser(['plan']); import shoal.plan"
RUN_CHECK = ("import sys; from shoal.cli import main; rc = main(['plan', '--scenario', {scenario!r}]); "
             "sys.exit(3 if 'torch' in sys.modules else rc)")


def _wall(argv: list[str], repeats: int) -> list[float]:
    """Wall seconds of ``argv`` run ``repeats`` times (output discarded; a failure raises)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        out.append(time.perf_counter() - t0)
    return out


def _planner_s(scenario: str, repeats: int) -> list[float]:
    """In-process seconds of ``make_plan`` alone (imports and scenario loading excluded)."""
    from shoal.plan import load_scenario, make_plan

    sc = load_scenario(scenario)
    make_plan(sc)  # warm-up: lazy imports inside the planner
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        make_plan(sc)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="gaming-world", help="built-in scenario or file (default: gaming-world)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each row (default: 5)")
    args = ap.parse_args()
    py = sys.executable
    rows = [
        ("python -c pass (interpreter start)", _wall([py, "-c", "pass"], args.repeats)),
        ("imports of the plan command", _wall([py, "-c", IMPORTS], args.repeats)),
        (f"shoal plan --scenario {args.scenario}", _wall([py, "-m", "shoal.cli", "plan", "--scenario",
                                                           args.scenario], args.repeats)),
        ("make_plan alone, in-process", _planner_s(args.scenario, args.repeats)),
    ]
    torch_free = subprocess.run([py, "-c", RUN_CHECK.format(scenario=args.scenario)], stdout=subprocess.DEVNULL,
                                env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    load = os.getloadavg()[0]
    print(f"repeats {args.repeats}, load average at end {load:.2f}, {os.cpu_count()} CPUs")
    print(f"{'what':44s} {'mean s':>8s} {'median s':>9s} {'min s':>7s}")
    for name, xs in rows:
        print(f"{name:44s} {statistics.mean(xs):8.3f} {statistics.median(xs):9.3f} {min(xs):7.3f}")
    print(f"torch imported by the command: {'yes' if torch_free == 3 else 'no' if torch_free == 0 else 'FAILED'}")
    cmd_mean = statistics.mean(rows[2][1])
    print(f"target: command <= 1.0 s -> {'met' if cmd_mean <= 1.0 else 'NOT met'} ({cmd_mean:.2f} s mean)")
    return 0 if torch_free == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
