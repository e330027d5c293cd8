"""``shoal plan``: plan a scenario, compare planners, list built-in scenarios."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shoal.errors import ShoalError
from shoal.plan.api import METHODS, make_plan
from shoal.plan.cost import stage_costs
from shoal.plan.scenario import BUILTIN_SCENARIOS, builtin_description, load_scenario
from shoal.plan.types import Plan, Scenario

# exhaustive search only runs where the instance is tiny; --compare skips it otherwise
COMPARE_METHODS = ("shoal", "dtfm", "swarm", "dapple", "random", "exhaustive")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan a scenario: stages, layers, servers, workers and predicted step time",
        description="Plan a scenario with shoal's allocator or a baseline and print the predicted costs.",
    )
    p.add_argument("--scenario", help="built-in scenario name (see --list) or a scenario JSON file")
    p.add_argument("--method", default="shoal", choices=sorted(METHODS), help="planner (default: shoal)")
    p.add_argument("--stages", type=int, default=None, help="force this many pipeline stages")
    p.add_argument("--seed", type=int, default=0, help="random seed of the planner")
    p.add_argument("--json", dest="json_out", default=None, help="write the plan (or comparison) as JSON here")
    p.add_argument("--tune-micro-batch", action="store_true",
                   help="shoal only: also choose the micro-batch size (the global batch stays fixed)")
    p.add_argument("--compare", action="store_true", help="run every method and compare predicted step times")
    p.add_argument("--list", action="store_true", help="list built-in scenarios")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.list:
        return _list(console)
    if not args.scenario:
        raise ShoalError("give --scenario NAME_OR_FILE (see `shoal plan --list`)")
    scenario = load_scenario(args.scenario)
    if args.compare:
        return _compare(console, scenario, args)
    plan = make_plan(scenario, method=args.method, seed=args.seed, stages=args.stages,
                     tune_micro_batch=args.tune_micro_batch)
    print_plan(console, plan, scenario)
    if args.json_out:
        plan.to_json(args.json_out)
        console.print(f"plan written to {args.json_out}")
    return 0


def _list(console: Console) -> int:
    table = Table(title="built-in scenarios (any scale-N with N <= 4096 also works)")
    table.add_column("name")
    table.add_column("description")
    for name in BUILTIN_SCENARIOS:
        table.add_row(name, builtin_description(name))
    console.print(table)
    return 0


def _fmt(t: float | None) -> str:
    if t is None or not math.isfinite(t):
        return "-"
    return f"{t:.3f}" if t < 10 else f"{t:.1f}"


def print_plan(console: Console, plan: Plan, scenario: Scenario) -> None:
    """A readable table of ``plan`` with its per-stage cost-model figures."""
    costs = stage_costs(plan, scenario)
    pred = plan.predicted
    table = Table(title=f"{plan.method} plan for {scenario.name} ({plan.model}, M={plan.micro_batches} x {plan.micro_batch_size})")
    for col in ("stage", "layers", "server", "workers", "tput mb/s", "sync s", "mem headroom"):
        table.add_column(col, justify="right" if col not in ("server", "workers") else "left")
    for i, (st, c) in enumerate(zip(plan.stages, costs, strict=True)):
        ws = ", ".join(st.workers[:6]) + (f" (+{len(st.workers) - 6})" if len(st.workers) > 6 else "")
        mark = " *" if i == int(pred.get("bottleneck_stage", -1)) else ""
        table.add_row(f"{i}{mark}", f"[{st.layers[0]}, {st.layers[1]})", st.server, f"{len(st.workers)}: {ws}",
                      f"{c.throughput:.3g}", _fmt(c.sync), f"{c.memory_headroom:.0%}")
    console.print(table)
    used = sum(len(st.workers) for st in plan.stages)
    console.print(
        f"predicted step {_fmt(pred.get('step_time_s'))} s = pipeline {_fmt(pred.get('pipeline_s'))} s "
        f"(compute {_fmt(pred.get('compute_s'))} s + transfer {_fmt(pred.get('transfer_s'))} s, fill/drain "
        f"{_fmt(pred.get('fill_drain_s'))} s) + sync {_fmt(pred.get('sync_s'))} s; "
        f"memory headroom {pred.get('memory_headroom', 0):.0%}; {used}/{len(scenario.workers)} devices used; "
        f"planned in {plan.planning_time_s:.2f} s   (* = bottleneck stage)"
    )
    if pred.get("churn_s"):
        console.print(f"with churn (long run): expected step {_fmt(pred.get('expected_step_time_s'))} s, of which "
                      f"{_fmt(pred.get('churn_s'))} s per step lost to leaves (the rest: devices away)")


def _simulator():
    """``shoal.sim.simulate`` if the simulator is installed, else None (plan never needs sim)."""
    try:
        from shoal.sim import simulate  # noqa: PLC0415 -- optional, lazy on purpose
    except ImportError:
        try:
            from shoal.sim.engine import simulate  # noqa: PLC0415
        except ImportError:
            return None
    return simulate


def _compare(console: Console, scenario: Scenario, args: argparse.Namespace) -> int:
    simulate = _simulator()
    rows = []
    for method in COMPARE_METHODS:
        t0 = time.perf_counter()
        try:
            plan = make_plan(scenario, method=method, seed=args.seed, stages=args.stages)
        except ShoalError as exc:
            if method == "exhaustive":
                continue  # too big for exhaustive search
            raise ShoalError(f"{method}: {exc}") from exc
        row = {"method": method, "baseline": method != "shoal", "stages": plan.n_stages,
               "devices_used": sum(len(s.workers) for s in plan.stages),
               "predicted_step_time_s": plan.predicted_step_time_s,
               "planning_time_s": time.perf_counter() - t0, "plan": plan.to_dict()}
        if simulate is not None:
            try:
                row["simulated_step_time_s"] = simulate(plan, scenario, steps=2, churn=False, seed=0).mean_step_time_s
            except Exception as exc:  # the simulator is someone else's; report, don't die
                row["simulated_step_time_s"] = None
                row["simulator_error"] = repr(exc)
        rows.append(row)
    shoal_t = next(r["predicted_step_time_s"] for r in rows if r["method"] == "shoal")
    table = Table(title=f"planners on {scenario.name} (judged by shoal's cost model; all but shoal are baselines)")
    for col in ("method", "stages", "devices", "predicted step s", "ratio to shoal", "planning s"):
        table.add_column(col, justify="right" if col != "method" else "left")
    if simulate is not None:
        table.add_column("simulated step s", justify="right")
    for r in rows:
        r["ratio_to_shoal"] = r["predicted_step_time_s"] / shoal_t if shoal_t else None
        cells = [r["method"], str(r["stages"]), str(r["devices_used"]), _fmt(r["predicted_step_time_s"]),
                 f"{r['ratio_to_shoal']:.2f}", f"{r['planning_time_s']:.2f}"]
        if simulate is not None:
            cells.append(_fmt(r.get("simulated_step_time_s")))
        table.add_row(*cells)
    console.print(table)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"scenario": scenario.name, "methods": rows}, indent=2) + "\n")
        console.print(f"comparison written to {args.json_out}")
    return 0
