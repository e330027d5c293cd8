"""Wall time of ``shoal plan --scenario gaming-world`` as a user runs it, and where it goes.

Each repeat starts a fresh Python process (what a user's shell does), so the figure includes
interpreter start-up and imports. Beside it, in the same run: the bare interpreter start, the
imports of the plan command (``shoal.cli`` building the ``plan`` parser plus ``shoal.plan``),
and the planner alone in-process (``make_plan`` on the loaded scenario, after a warm-up call).
Also checks that the command never imports torch.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_cli_start.py [--scenario gaming-world] [--repeats 5]

Target (issue #11): the command's wall time <= 1 s on an idle machine.

An installed shoal has its bytecode cached (pip compiles it), so the bench byte-compiles the
``shoal`` package first (``__pycache__`` is git-ignored); ``--from-source`` skips that and
measures a checkout that cannot write bytecode (``PYTHONDONTWRITEBYTECODE=1``), where every
run compiles shoal's modules again (about 0.15 s more).
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

IMPORTS = "from shoal.cli import build_parser; build_parser(['plan']); import shoal.plan"
RUN_CHECK = ("import sys; from shoal.cli import main; rc = main(['plan', '--scenario', {scenario!r}]); "
             "sys.exit(3 if 'torch' in sys.modules else rc)")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _wall(argv: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of ``argv`` run ``repeats`` times (output discarded; a failure raises).
    CPU seconds (user + system of the child) are what a busy machine inflates least."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = _children_cpu(), time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        wall.append(time.perf_counter() - t0)
        cpu.append(_children_cpu() - c0)
    return wall, cpu


def _planner_s(scenario: str, repeats: int) -> tuple[list[float], list[float]]:
    """In-process wall and CPU seconds of ``make_plan`` alone (imports and scenario loading excluded)."""
    from shoal.plan import load_scenario, make_plan

    sc = load_scenario(scenario)
    make_plan(sc)  # warm-up: lazy imports inside the planner
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        make_plan(sc)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="gaming-world", help="built-in scenario or file (default: gaming-world)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each row (default: 5)")
    ap.add_argument("--from-source", action="store_true", help="do not byte-compile shoal first (see above)")
    args = ap.parse_args()
    py = sys.executable
    if not args.from_source:
        import shoal

        compileall.compile_dir(str(Path(shoal.__file__).parent), quiet=1)
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
    print(f"repeats {args.repeats}, load average at end {load:.2f}, {os.cpu_count()} CPUs, shoal bytecode "
          f"{'compiled on every run' if args.from_source else 'cached'}")
    print(f"{'what':44s} {'wall mean s':>11s} {'wall min s':>10s} {'CPU mean s':>10s} {'CPU min s':>9s}")
    for name, (wall, cpu) in rows:
        print(f"{name:44s} {statistics.mean(wall):11.3f} {min(wall):10.3f} {statistics.mean(cpu):10.3f} "
              f"{min(cpu):9.3f}")
    print(f"torch imported by the command: {'yes' if torch_free == 3 else 'no' if torch_free == 0 else 'FAILED'}")
    cmd_mean = statistics.mean(rows[2][1][0])
    print(f"target: command <= 1.0 s wall on an idle machine -> {'met' if cmd_mean <= 1.0 else 'NOT met'} "
          f"({cmd_mean:.2f} s mean at this load)")
    return 0 if torch_free == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
