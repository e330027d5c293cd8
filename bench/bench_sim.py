"""Simulator benchmark: cost-model agreement, speed, and every planner judged by the simulator.

Run from the repository root (one process, one thread):

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sim.py            # everything but scale-4096
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sim.py --quick    # small scenarios, shoal + swarm
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sim.py --big      # add scale-4096
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sim.py --agreement [--big]  # table 1 only

Prints three markdown tables (also written to ``--out``):

1. agreement -- for shoal's plan on each built-in scenario, the cost model's predicted step
   time (and its pipeline / sync parts) against the simulated ones, without churn;
2. speed -- events per second of every simulation run, and one step of ``scale-1024``;
3. comparison -- simulated step time of every planner method on every scenario, without and
   with churn, and its ratio to shoal's.

Ratios within one run only: no timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from shoal.errors import ShoalError  # noqa: E402
from shoal.plan import BUILTIN_SCENARIOS, METHODS, load_scenario, make_plan  # noqa: E402
from shoal.sim import simulate  # noqa: E402

SMALL = ("demo", "hetero-compute", "hetero-network", "hetero-churn", "hetero-all", "gaming-eu", "dtfm-2")


def _fmt(x: float | None, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def engine_micro(workers: int = 256, tasks: int = 100_000) -> list[list[str]]:
    """The same worker loop (lease, input, compute, output) as SimPy processes and as a bare
    heap loop: the reason the simulator is a hand-written heap loop. SimPy is not a dependency;
    the SimPy row is skipped when it is not importable."""
    import heapq
    import itertools
    import random

    rows = []
    speeds = [random.Random(i).uniform(0.05, 0.2) for i in range(workers)]
    try:
        import simpy
    except ImportError:
        simpy = None
    if simpy is not None:
        env = simpy.Environment()
        pool = simpy.Store(env)
        pool.items.extend(range(tasks))
        count = [0]

        def worker(c):
            while True:
                yield pool.get()
                yield env.timeout(0.01)
                yield env.timeout(c)
                yield env.timeout(0.01)
                count[0] += 4

        for c in speeds:
            env.process(worker(c))
        t0 = time.perf_counter()
        env.run()
        dt = time.perf_counter() - t0
        rows.append(["SimPy 4 processes", f"{count[0]:,}", _fmt(dt), f"{count[0] / dt:,.0f}"])
    heap: list = []
    seq = itertools.count().__next__
    left, n = tasks, 0
    for w in range(workers):
        heapq.heappush(heap, (0.0, seq(), 0, w))
    t0 = time.perf_counter()
    while heap:
        t, _, k, w = heapq.heappop(heap)
        n += 1
        if k == 0:
            if left:
                left -= 1
                heapq.heappush(heap, (t + 0.01, seq(), 1, w))
        elif k == 1:
            heapq.heappush(heap, (t + speeds[w], seq(), 2, w))
        else:
            heapq.heappush(heap, (t + 0.01, seq(), 0, w))
    dt = time.perf_counter() - t0
    rows.append(["heap loop", f"{n:,}", _fmt(dt), f"{n / dt:,.0f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small scenarios and two methods only")
    ap.add_argument("--big", action="store_true", help="include scale-4096")
    ap.add_argument("--scenarios", nargs="*", help="scenario names (default: every built-in)")
    ap.add_argument("--methods", nargs="*", help="planner methods (default: every method)")
    ap.add_argument("--steps", type=int, default=2, help="steps per run without churn (default 2)")
    ap.add_argument("--churn-steps", type=int, default=6, help="steps per run with churn (default 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--agreement", action="store_true",
                    help="only the agreement table: shoal's plans, no churn (every built-in; --big adds scale-4096)")
    ap.add_argument("--engine-micro", action="store_true",
                    help="only compare SimPy with a bare heap loop on the worker loop (needs simpy importable)")
    args = ap.parse_args(argv)
    if args.engine_micro:
        print(_table(["engine", "events", "wall s", "events/s"], engine_micro()))
        return 0

    if args.scenarios:
        names = args.scenarios
    elif args.quick:
        names = list(SMALL)
    else:
        names = [n for n in BUILTIN_SCENARIOS if args.big or n != "scale-4096"]
    methods = args.methods or (["shoal", "swarm"] if args.quick else list(METHODS))
    if args.agreement:
        methods = ["shoal"]
    t_start = time.perf_counter()
    agreement, speed, comparison = [], [], []
    total_events, total_wall, total_cpu = 0, 0.0, 0.0

    for name in names:
        scn = load_scenario(name)
        sims: dict[str, tuple[float | None, float | None]] = {}
        for method in methods:
            try:
                plan = make_plan(scn, method=method, seed=args.seed)
            except ShoalError as exc:
                print(f"# {name}/{method}: no plan ({exc})", file=sys.stderr, flush=True)
                sims[method] = (None, None)
                continue
            r = simulate(plan, scn, steps=args.steps, seed=args.seed)
            rc = r if args.agreement else simulate(plan, scn, steps=args.churn_steps, churn=True, seed=args.seed)
            for res in ((r,) if args.agreement else (r, rc)):
                total_events += res.events
                total_wall += res.wall_time_s
                total_cpu += res.cpu_time_s
                speed.append([name, method, "on" if res.churn else "off", str(res.steps), str(res.events),
                              _fmt(res.wall_time_s), f"{res.events_per_s:,.0f}", _fmt(res.cpu_time_s),
                              f"{res.events_per_cpu_s:,.0f}", _fmt(res.repair_wall_s)])
            sims[method] = (r.mean_step_time_s, rc.mean_step_time_s)
            if method == "shoal":
                pr = plan.predicted
                sim_pipe = r.mean_pipeline_s
                agreement.append([
                    name, str(plan.n_stages), str(sum(len(s.workers) for s in plan.stages)), str(plan.micro_batches),
                    _fmt(pr["step_time_s"]), _fmt(r.mean_step_time_s), _fmt(pr["step_time_s"] / r.mean_step_time_s, 3),
                    _fmt(pr["pipeline_s"]), _fmt(sim_pipe), _fmt(pr["sync_s"]), _fmt(r.mean_step_time_s - sim_pipe),
                    "yes" if abs(pr["step_time_s"] / r.mean_step_time_s - 1) <= 0.10 else "NO",
                ])
            print(f"# {name}/{method}: sim {_fmt(r.mean_step_time_s)} s, churn {_fmt(rc.mean_step_time_s)} s "
                  f"(leaves {rc.leaves}, requeued {rc.requeued_tasks}, lost {r.lost_micro_batches + rc.lost_micro_batches}), "
                  f"{r.events_per_s:,.0f} ev/s", file=sys.stderr, flush=True)
        base, base_c = sims.get("shoal", (None, None))
        for method in methods:
            s, c = sims[method]
            comparison.append([name, method, _fmt(s), _fmt(c),
                               _fmt(s / base if s and base else None), _fmt(c / base_c if c and base_c else None)])

    # one step of scale-1024 on its own (the speed target)
    scale_row = None
    if not args.quick and not args.scenarios and not args.agreement:
        scn = load_scenario("scale-1024")
        plan = make_plan(scn, "shoal", seed=args.seed)
        r = simulate(plan, scn, steps=1)
        scale_row = [str(r.events), _fmt(r.wall_time_s), f"{r.events_per_s:,.0f}", _fmt(r.cpu_time_s),
                     f"{r.events_per_cpu_s:,.0f}", f"{os.getloadavg()[0]:.1f}"]

    parts = [
        "### Agreement: cost model vs simulator (shoal's plans, no churn)\n",
        _table(["scenario", "S", "workers", "M", "predicted s", "simulated s", "pred/sim",
                "pipeline pred", "pipeline sim", "sync pred", "sync sim", "within 10 %"], agreement),
        "\n### Speed\n",
        f"All runs: {total_events:,} events in {total_wall:.1f} s wall = "
        f"{total_events / total_wall if total_wall else 0:,.0f} events/s; {total_cpu:.1f} CPU s = "
        f"{total_events / total_cpu if total_cpu else 0:,.0f} events per CPU second "
        f"(load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores).\n",
    ]
    if args.agreement:
        parts = parts[:2]
    elif scale_row:
        parts.append(_table(["scale-1024, one step: events", "wall s", "events/s", "CPU s", "events/CPU s",
                             "load avg"], [scale_row]))
    parts += [] if args.agreement else [
        "\n### Comparison: simulated step time (s) per method, without and with churn\n",
        _table(["scenario", "method", "step s", "step s (churn)", "/ shoal", "/ shoal (churn)"], comparison),
        "\n<details><summary>per-run speed</summary>\n",
        _table(["scenario", "method", "churn", "steps", "events", "wall s", "events/s", "CPU s", "events/CPU s",
                "repair wall s"], speed),
        "\n</details>\n",
    ]
    parts += [
        f"\nbench wall time {time.perf_counter() - t_start:.0f} s; steps {args.steps} (churn {args.churn_steps}), "
        f"seed {args.seed}.",
    ]
    text = "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
