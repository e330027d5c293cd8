"""The plans shoal chooses for the built-in scenarios, to check that a planner speed-up changes
nothing: the predicted step time (every digit), stage count, devices used and a digest of the
plan (layers, servers, workers) per scenario, under exact sync and under
``--sync local --sync-every 8 --compression int8`` (the flags parsed as ``shoal plan`` parses
them), with the planner's CPU seconds beside.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_plan_digits.py --save before.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_plan_digits.py --check before.json

Local search runs without its wall-clock safety net (``budget_s=1e9``), so a loaded machine
cannot cut it short and the result depends only on the code. scale-1024 and scale-4096 are
skipped unless named with ``--scenarios``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

POLICIES = {"exact": [], "local8-int8": ["--sync", "local", "--sync-every", "8", "--compression", "int8"]}
SKIP = ("scale-1024", "scale-4096")


def plan_row(name: str, flags: list[str]) -> dict:
    """Plan ``name`` as ``shoal plan --scenario name FLAGS`` would (minus the safety net)."""
    from shoal.cli import build_parser
    from shoal.plan import load_scenario, predict, validate_plan
    from shoal.plan.allocator import plan_shoal
    from shoal.plan.cli import policy_from_args

    argv = ["plan", "--scenario", name, *flags]
    policy = policy_from_args(build_parser(argv).parse_args(argv))
    s = load_scenario(name)
    c0 = time.process_time()
    p = plan_shoal(s, sync=policy, budget_s=1e9)
    cpu = time.process_time() - c0
    validate_plan(p, s)
    pred = predict(p, s)
    layout = [[list(st.layers), st.server, list(st.workers)] for st in p.stages]
    return {"step_time_s": repr(pred["step_time_s"]), "expected_step_time_s": repr(pred["expected_step_time_s"]),
            "stages": p.n_stages, "devices_used": sum(len(st.workers) for st in p.stages),
            "digest": hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:12], "planner_cpu_s": cpu}


def main() -> int:
    from shoal.plan import BUILTIN_SCENARIOS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="*", default=None, help="built-in scenarios (default: all but scale-1024/4096)")
    ap.add_argument("--save", default=None, help="write the rows as JSON here")
    ap.add_argument("--check", default=None, help="compare with rows saved earlier; exit 1 on any difference")
    args = ap.parse_args()
    names = args.scenarios or [n for n in BUILTIN_SCENARIOS if n not in SKIP]
    ref = json.loads(Path(args.check).read_text()) if args.check else {}
    rows: dict[str, dict] = {}
    diffs = 0
    print(f"{'scenario':16s} {'policy':12s} {'predicted step s':>22s} {'S':>3s} {'used':>5s} {'plan digest':12s} "
          f"{'planner CPU s':>13s}  same")
    for name in names:
        for label, flags in POLICIES.items():
            key = f"{name}/{label}"
            r = rows[key] = plan_row(name, flags)
            same = ""
            if key in ref:
                want = {k: v for k, v in ref[key].items() if k != "planner_cpu_s"}
                got = {k: v for k, v in r.items() if k != "planner_cpu_s"}
                same = "yes" if want == got else f"NO (was {ref[key]['step_time_s']}, {ref[key]['digest']})"
                diffs += want != got
            print(f"{name:16s} {label:12s} {r['step_time_s']:>22s} {r['stages']:3d} {r['devices_used']:5d} "
                  f"{r['digest']:12s} {r['planner_cpu_s']:13.2f}  {same}", flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps(rows, indent=1) + "\n")
    if args.check:
        total = {k: ref[k]["planner_cpu_s"] for k in rows if k in ref}
        print(f"planner CPU s, these rows: {sum(r['planner_cpu_s'] for r in rows.values()):.2f} now, "
              f"{sum(total.values()):.2f} in {args.check}; {diffs} plan(s) differ")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
