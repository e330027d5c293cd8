"""``shoal plan``: plan a scenario, compare planners, list built-in scenarios."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.errors import ShoalError
from shoal.plan.api import METHODS, make_plan
from shoal.plan.auto import (
    DEFAULT_CODECS,
    DEFAULT_MAX_SYNC_EVERY,
    QualityBudget,
    act_note,
    lean_note,
    overlap_note,
    parse_allowed_codecs,
    plan_auto,
    quality_note,
)
from shoal.plan.cost import stage_costs
from shoal.plan.replicas import judged_report
from shoal.plan.report import IDLE_REASONS, SwarmReport
from shoal.plan.scenario import BUILTIN_SCENARIOS, builtin_description, load_scenario
from shoal.plan.types import Plan, Scenario, SyncPolicy

if TYPE_CHECKING:
    from rich.console import Console

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
    p.add_argument("--standbys", type=int, default=0, metavar="N",
                   help="place N hot standby servers per stage on other reliable hosts and count their copies")
    p.add_argument("--ckpt-every", type=int, default=1, metavar="K",
                   help="with --standbys: steps between a standby's copies of its stage's state (default 1)")
    p.add_argument("--tune-micro-batch", action="store_true",
                   help="shoal only: also choose the micro-batch size (the global batch stays fixed)")
    p.add_argument("--compare", action="store_true",
                   help="run every method and compare tokens/s, the share of the swarm's FLOP limit and devices used (exact sync and, "
                        "with --sync local, the allowed policy)")
    p.add_argument("--list", action="store_true", help="list built-in scenarios")
    add_sync_arguments(p)
    p.set_defaults(func=run)


def add_sync_arguments(p) -> None:
    """``--sync``, ``--sync-every``, ``--compression``, ``--no-overlap``, ``--overlap-io`` (shared
    by ``shoal plan`` and ``shoal simulate``)."""
    p.add_argument("--sync", choices=("auto", "exact", "local"), default="auto",
                   help="parameter sync: auto (the planner chooses exact or local, H, codecs and replicas under "
                        "the quality budget: --max-sync-every, --allow-codecs, --no-replicas), exact (every step) "
                        "or local (DiLoCo-style rounds every --sync-every steps; see docs/sync-policies.md)")
    p.add_argument("--sync-every", type=int, default=None, metavar="H",
                   help="local mode: steps between sync rounds (default 32); with --sync auto: pins H")
    p.add_argument("--max-sync-every", type=int, default=None, metavar="H",
                   help=f"--sync auto: the largest H (steps between merges) the planner may choose "
                        f"(default {DEFAULT_MAX_SYNC_EVERY}; 1: exact sync only)")
    p.add_argument("--allow-codecs", default=None, metavar="LIST",
                   help=f"--sync auto: codecs the planner may use, e.g. none,int8 (default "
                        f"{','.join(DEFAULT_CODECS)}; sparse and lowrank only on pushes and pulls, tern, quad, oct and quad-pc only on activations, "
                        "tern-sr and tern-dither only on their gradients)")
    p.add_argument("--no-replicas", action="store_true",
                   help="--sync auto: do not consider pipeline replicas (one pipeline only)")
    p.add_argument("--compression", default="", metavar="SPEC",
                   help="codec per traffic kind: one codec for all (none, fp16, int8) or "
                        "act=..,grad=..,push=..,pull=.. (push/pull also topk-int8[:DENSITY], sparse, lowrank[:RANK[:BITS]]; "
                        "act/grad also tern: 9x fewer bytes than bf16; tern alone: act=tern,grad=tern; "
                        "act=quad,grad=tern-sr: 8.3x fewer, unbiased gradients; act=oct,grad=tern-dither: 8.1x fewer)")
    p.add_argument("--no-overlap", action="store_true",
                   help="local mode: steps wait for each sync round instead of overlapping it with the next round "
                        "(with --sync auto: a budget that leaves delayed application out)")
    p.add_argument("--lean-workers", action="store_true",
                   help="local mode: workers hold 12 bytes a parameter instead of 20 (backward sums the step's "
                        "gradients; bf16 inner AdamW moments), as `shoal launch --lean-workers` runs them")
    p.add_argument("--no-lean", action="store_true",
                   help="--sync auto: do not consider lean local-mode workers (--lean-workers)")
    p.add_argument("--replicas", action="store_true",
                   help="local mode: run several pipeline replicas, each inside one network cluster, of the "
                        "stage count each device's memory needs (see docs/planner.md)")
    p.add_argument("--unordered-grads", action="store_true",
                   help="exact sync: price one summed gradient push per worker a step, as `shoal launch "
                        "--unordered-grads` and `shoal demo` run it (not bitwise exact); by default a worker of "
                        "a shared stage pushes each micro-batch's gradient alone, as launch does for bitwise parity")
    p.add_argument("--overlap-io", choices=("auto", "off", "uploads", "prefetch"), default="auto",
                   help="worker I/O overlap: uploads (upload an output while leasing and computing the next task), "
                        "prefetch (also fetch the next task during compute); auto: uploads in local mode, off in exact")


DEFAULT_SYNC_EVERY = 32  # local mode's H when --sync-every is not given


def policy_from_args(args: argparse.Namespace) -> SyncPolicy:
    """The :class:`SyncPolicy` the sync flags describe (``SyncPolicy()`` for the defaults)."""
    from shoal.plan.compression import parse_compression

    codecs = parse_compression(getattr(args, "compression", "") or "")
    mode = getattr(args, "sync", "exact") or "exact"
    if mode == "auto":
        budget_from_args(args)  # checks the flags; the policy is the planner's choice
        return SyncPolicy()
    every = getattr(args, "sync_every", None)
    if every is not None and every < 1:
        raise ShoalError(f"--sync-every must be a positive number of steps, got {every}")
    if mode == "exact" and every not in (None, 1):
        raise ShoalError("--sync-every only applies to --sync local (exact sync syncs every step)")
    io = getattr(args, "overlap_io", "auto") or "auto"
    if getattr(args, "replicas", False) and mode != "local":
        raise ShoalError("--replicas needs --sync local (replicas merge every H steps)")
    if getattr(args, "lean_workers", False) and mode != "local":
        raise ShoalError("--lean-workers needs --sync local (exact sync's workers hold no optimizer; "
                         "--sync auto weighs lean workers by itself, --no-lean: not)")
    if io == "auto":
        # replica pipelines are short and their workers few: a slow uplink that takes tasks while
        # its uploads queue ends the step late, so replicas keep uploads in line (measured:
        # gaming-world's simulated step 6.7 s with overlapped uploads, 4.9 s without)
        io = "uploads" if mode == "local" and not getattr(args, "replicas", False) else "off"
    return SyncPolicy(mode="local" if mode == "local" else "sync",
                      sync_every=(every or DEFAULT_SYNC_EVERY) if mode == "local" else 1,
                      act_codec=codecs["act"], grad_codec=codecs["grad"], push_codec=codecs["push"],
                      pull_codec=codecs["pull"], overlap=not getattr(args, "no_overlap", False),
                      overlap_uploads=io in ("uploads", "prefetch"), prefetch=io == "prefetch",
                      lean=mode == "local" and getattr(args, "lean_workers", False),
                      ordered=mode == "exact" and not getattr(args, "unordered_grads", False))


def budget_from_args(args: argparse.Namespace) -> QualityBudget | None:
    """The quality budget of ``--sync auto`` (None for exact or local): ``--max-sync-every``,
    ``--allow-codecs``, ``--no-replicas``; ``--sync-every`` and ``--compression`` pin H and the codecs."""
    from shoal.plan.compression import parse_compression

    mode = getattr(args, "sync", "exact") or "exact"
    top = getattr(args, "max_sync_every", None)
    allow = getattr(args, "allow_codecs", None)
    if mode != "auto":
        if (top is not None or allow is not None or getattr(args, "no_replicas", False)
                or getattr(args, "no_lean", False)):
            raise ShoalError("--max-sync-every, --allow-codecs, --no-replicas and --no-lean are the budget of "
                             f"--sync auto; drop them with --sync {mode}")
        return None
    if getattr(args, "replicas", False):
        raise ShoalError("--replicas needs --sync local; --sync auto considers replicas by itself (--no-replicas: not)")
    if getattr(args, "lean_workers", False):
        raise ShoalError("--lean-workers needs --sync local; --sync auto weighs lean workers by itself (--no-lean: not)")
    if (getattr(args, "overlap_io", "auto") or "auto") != "auto":
        raise ShoalError("--overlap-io applies to --sync local or exact; --sync auto chooses it")
    if top is not None and top < 1:
        raise ShoalError(f"--max-sync-every must be a positive number of steps, got {top}")
    every = getattr(args, "sync_every", None)
    if every is not None and every < 1:
        raise ShoalError(f"--sync-every must be a positive number of steps, got {every}")
    top = top if top is not None else max(DEFAULT_MAX_SYNC_EVERY, every or 0)
    if every is not None and every > top:
        raise ShoalError(f"--sync-every {every} is above --max-sync-every {top}")
    spec = getattr(args, "compression", "") or ""
    return QualityBudget(max_sync_every=top, codecs=parse_allowed_codecs(allow) if allow else DEFAULT_CODECS,
                         local=top > 1, replicas=not getattr(args, "no_replicas", False), pin_sync_every=every,
                         pin_codecs=parse_compression(spec) if spec else None,
                         overlap=not getattr(args, "no_overlap", False), lean=not getattr(args, "no_lean", False))


def auto_applies(args: argparse.Namespace) -> bool:
    """Whether ``--sync auto`` chooses the policy: shoal's own plan without a forced shape (the
    baselines, --stages, --standbys and --tune-micro-batch plan exact sync)."""
    return (getattr(args, "method", "shoal") == "shoal" and getattr(args, "stages", None) is None
            and not getattr(args, "standbys", 0) and not getattr(args, "tune_micro_batch", False))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console  # only when printing: `shoal simulate` imports this module too

    console = Console()
    if args.list:
        return _list(console)
    if not args.scenario:
        raise ShoalError("give --scenario NAME_OR_FILE (see `shoal plan --list`)")
    scenario = load_scenario(args.scenario)
    policy = policy_from_args(args)
    budget = budget_from_args(args)
    if args.compare:
        return _compare(console, scenario, args, policy, budget)
    # (a spinner on a terminal, nothing otherwise: a large swarm takes a minute to plan)
    what = f"planning {scenario.name} ({len(scenario.devices)} devices)"
    if budget is not None and auto_applies(args):
        with console.status(what) as status:
            plan = plan_auto(scenario, budget, seed=args.seed,
                             on_progress=lambda step: status.update(f"{what}: {step}"))
        console.print(f"sync auto: {describe_policy(plan)} (quality budget: {describe_budget(budget)})")
        for note in (quality_note(plan.sync), act_note(plan.sync), lean_note(plan.sync), overlap_note(plan.sync)):
            if note:
                console.print(note)
        print_plan(console, plan, scenario)
        if args.json_out:
            plan.to_json(args.json_out)
            console.print(f"plan written to {args.json_out}")
        return 0
    with console.status(what):
        plan = make_plan(scenario, method=args.method, seed=args.seed, stages=args.stages,
                         tune_micro_batch=args.tune_micro_batch, sync=policy, standbys=args.standbys,
                         standby_every=args.ckpt_every, replicas=args.replicas)
    print_plan(console, plan, scenario)
    if args.json_out:
        plan.to_json(args.json_out)
        console.print(f"plan written to {args.json_out}")
    return 0


def _list(console: Console) -> int:
    from rich.table import Table

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
    from rich.table import Table

    if plan.replicas:
        print_replica_plan(console, plan, scenario)
        return
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
    if any(st.standbys for st in plan.stages):
        log = f"; step log {_fmt(pred.get('standby_log_s'))} s per step" if pred.get("standby_log_s") else ""
        console.print(f"standbys (state copied every {plan.standby_every} step(s), {_fmt(pred.get('standby_s'))} s "
                      f"per step on the busiest active uplink{log}): " + "; ".join(
                          f"stage {i}: {', '.join(st.standbys)}" for i, st in enumerate(plan.stages)))
    pol = plan.sync
    if pol.local:
        console.print(f"sync: local, a round every {pol.sync_every} steps ({_fmt(pred.get('sync_round_s'))} s at full "
                      f"link rate, {'overlapped with the next round' if pol.overlap else 'not overlapped'}); codecs "
                      f"act={pol.act_codec} grad={pol.grad_codec} push={pol.push_codec} pull={pol.pull_codec}")
        print_dense_round(console, plan, scenario)
    elif any(c != "none" for c in (pol.act_codec, pol.grad_codec, pol.push_codec, pol.pull_codec)):
        console.print(f"sync: exact; codecs act={pol.act_codec} grad={pol.grad_codec} push={pol.push_codec} "
                      f"pull={pol.pull_codec}")
    if not pol.local and pol.ordered and any(len(st.workers) > 1 for st in plan.stages):
        console.print("sync: exact, as shoal launch runs it: a worker of a shared stage pushes each "
                      "micro-batch's gradient alone (summed in micro-batch order for bitwise parity with "
                      "shoal train --local); --unordered-grads prices one summed push a worker (not bitwise)")
    console.print(
        f"predicted step {_fmt(pred.get('step_time_s'))} s = pipeline {_fmt(pred.get('pipeline_s'))} s "
        f"(compute {_fmt(pred.get('compute_s'))} s + transfer {_fmt(pred.get('transfer_s'))} s, fill/drain "
        f"{_fmt(pred.get('fill_drain_s'))} s) + sync {_fmt(pred.get('sync_s'))} s; "
        f"memory headroom {pred.get('memory_headroom', 0):.0%}; "
        f"planned in {plan.planning_time_s:.2f} s   (* = bottleneck stage)"
    )
    print_cpu(console, pred)
    print_swarm(console, judged_report(plan, scenario)[0])
    if pred.get("churn_s"):
        console.print(f"with churn (long run): expected step {_fmt(pred.get('expected_step_time_s'))} s, of which "
                      f"{_fmt(pred.get('churn_s'))} s per step lost to leaves (the rest: devices away)")


def describe_policy(plan: Plan) -> str:
    """One phrase: the plan's sync policy and shape."""
    pol = plan.sync
    if not pol.local:
        return "exact sync"
    shape = f"{len(plan.replicas)} pipeline replicas" if plan.replicas else "one pipeline"
    return (f"local, H={pol.sync_every}, push={pol.push_codec} pull={pol.pull_codec} act={pol.act_codec} "
            f"grad={pol.grad_codec}, {shape}{' of lean workers' if pol.lean else ''}")


def describe_budget(budget: QualityBudget) -> str:
    """One phrase: what the quality budget allows."""
    if not budget.local:
        return "exact only"
    hs = budget.sync_every_choices()
    h = f"H in {hs}" if hs else "no H"
    codecs = (", ".join(f"{k}={v}" for k, v in budget.pin_codecs.items()) if budget.pin_codecs
              else "codecs " + ",".join(budget.codecs))
    return (f"{h}, {codecs}, replicas {'allowed' if budget.replicas else 'excluded'}, "
            f"lean workers {'allowed' if budget.lean else 'excluded'}")


def print_replica_plan(console: Console, plan: Plan, scenario: Scenario) -> None:
    """A readable table of a replica plan: per replica its cluster, micro-batches and stages."""
    from rich.table import Table

    from shoal.plan.cost import predict, replica_plan

    pred = plan.predicted
    table = Table(title=f"{plan.method} plan for {scenario.name} ({plan.model}, M={plan.micro_batches} x "
                        f"{plan.micro_batch_size}): {len(plan.replicas)} pipeline replicas")
    for col in ("replica", "cluster", "micro-batches", "stages: layers / server / workers", "pipeline s"):
        table.add_column(col, justify="left" if col in ("cluster", "stages: layers / server / workers") else "right")
    for i, r in enumerate(plan.replicas):
        p_r = predict(replica_plan(plan, r), scenario)["pipeline_s"]
        desc = "; ".join(f"[{st.layers[0]}, {st.layers[1]}) {st.server} {len(st.workers)}" for st in r.stages)
        table.add_row(str(i), r.cluster, str(r.micro_batches), desc, _fmt(p_r))
    plan.predicted = pred
    console.print(table)
    pol = plan.sync
    console.print(f"sync: local, a round every {pol.sync_every} steps ({_fmt(pred.get('sync_round_s'))} s at full link "
                  f"rate, of which the servers' outer merge {_fmt(pred.get('outer_merge_s'))} s; "
                  f"{'overlapped with the next round' if pol.overlap else 'not overlapped'}); codecs "
                  f"act={pol.act_codec} grad={pol.grad_codec} push={pol.push_codec} pull={pol.pull_codec}")
    print_dense_round(console, plan, scenario)
    console.print(f"predicted step {_fmt(pred.get('step_time_s'))} s = pipeline {_fmt(pred.get('pipeline_s'))} s "
                  f"(the slowest replica) + sync {_fmt(pred.get('sync_s'))} s; memory headroom "
                  f"{pred.get('memory_headroom', 0):.0%}; planned in {plan.planning_time_s:.2f} s")
    print_cpu(console, pred)
    print_swarm(console, judged_report(plan, scenario)[0])
    if pred.get("churn_s"):
        console.print(f"with churn (long run): expected step {_fmt(pred.get('expected_step_time_s'))} s")


def print_dense_round(console: Console, plan: Plan, scenario: Scenario) -> None:
    """One line where the run ends with a dense round (sparse or lowrank pushes): its one-off time."""
    from shoal.plan.cost import dense_round_time, scenario_profile

    t = dense_round_time(plan, scenario, scenario_profile(scenario, plan.micro_batch_size))
    if t > 0:
        codec = plan.sync.push_codec.split(":")[0]
        console.print(f"the run's last round is dense ({codec} pushes keep what they leave): every worker sends its "
                      f"stage in int8 once, about {_fmt(t)} s at full link rate, not in the step above")


def print_cpu(console: Console, pred: dict) -> None:
    """One line: the framework's CPU at the predicted step (busiest server host, coordinator)."""
    if "server_cpu_share" not in pred:
        return
    console.print(f"framework CPU: the busiest server host's cores {pred['server_cpu_share']:.0%} busy; "
                  f"coordinator {int(pred['coordinator_members'])} members, {pred['coordinator_cores']:.2f} cores")


def print_swarm(console: Console, rep: SwarmReport, label: str = "predicted") -> None:
    """The swarm figures: tokens/s against the FLOP limit, devices used, and why the rest are idle."""
    console.print(f"{label}: {rep.summary()}")
    by_reason: dict[str, list[str]] = {}
    for dev, reason in sorted(rep.idle.items()):
        by_reason.setdefault(reason, []).append(dev)
    for reason, devs in by_reason.items():
        console.print(f"  idle for {reason}: {len(devs)} ({', '.join(devs[:4])}{' ...' if len(devs) > 4 else ''}); "
                      f"e.g. {devs[0]}: {rep.why[devs[0]]}")
    for line in rep.cpu_bound.values():
        console.print(f"  {line}")


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


def _compare_row(method: str, scenario: Scenario, args: argparse.Namespace, policy: SyncPolicy,
                 simulate, label: str, replicas: bool = False) -> dict | None:
    """One method under one policy: plan (baselines keep their placement rule and are judged under
    ``policy``; shoal plans for it), predict, and simulate when the simulator is there."""
    t0 = time.perf_counter()
    try:
        if method == "shoal" or not policy.local:
            plan = make_plan(scenario, method=method, seed=args.seed, stages=args.stages, sync=policy,
                             replicas=replicas and method == "shoal")
        else:
            # a baseline does not know local mode: its exact-sync placement, run under the policy
            plan = make_plan(scenario, method=method, seed=args.seed, stages=args.stages)
            plan.sync = policy
            from shoal.plan.cost import predict
            from shoal.plan.validate import validate_plan

            validate_plan(plan, scenario)
            predict(plan, scenario)
    except ShoalError as exc:
        if method == "exhaustive":
            return None  # too big for exhaustive search
        return {"method": method, "policy": label, "error": str(exc)}
    rep = judged_report(plan, scenario)[0]
    row = {"method": method, "policy": label, "baseline": method != "shoal", "stages": plan.n_stages,
           "replicas": len(plan.pipelines),
           "devices_used": rep.devices_used, "devices_available": rep.devices_available,
           "idle_counts": rep.idle_counts(),
           "predicted_step_time_s": plan.predicted_step_time_s,
           "predicted_tokens_per_s": rep.tokens_per_s, "predicted_flop_share": rep.flop_share,
           "predicted_utilisation": plan.predicted.get("utilisation"),
           "planning_time_s": time.perf_counter() - t0, "plan": plan.to_dict()}
    if simulate is not None:
        steps, sim_plan = 2, plan
        if policy.local and policy.sync_every > 2:
            # a round compressed to 2 steps: 2 / H of its bytes, so each step carries the same
            # background bytes and share of the round's wait at 2 / H of the events
            from dataclasses import replace

            sim_plan = replace(plan, sync=replace(policy, sync_every=2,
                                                  grad_compression=policy.grad_compression * 2 / policy.sync_every))
        try:
            res = simulate(sim_plan, scenario, steps=steps, churn=False, seed=0)
            row["simulated_step_time_s"] = res.mean_step_time_s
            row["simulated_tokens_per_s"] = res.tokens_per_s
            row["simulated_flop_share"] = res.tokens_per_s / rep.flop_limit_tokens_per_s \
                if rep.flop_limit_tokens_per_s > 0 else None
            row["simulated_utilisation"] = res.mean_utilisation()
        except Exception as exc:  # the simulator is someone else's; report, don't die
            row["simulated_step_time_s"] = None
            row["simulator_error"] = repr(exc)
    return row


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.0%}"


def _pct1(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1%}" if x >= 0.01 else f"{x:.2g}%" if x <= 0 else f"{100 * x:.2g}%"


def _tps(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.0f}"


def _compare(console: Console, scenario: Scenario, args: argparse.Namespace, policy: SyncPolicy | None = None,
             budget: QualityBudget | None = None) -> int:
    simulate = _simulator()
    policy = policy or SyncPolicy()
    replicas = bool(getattr(args, "replicas", False))
    what = f"comparing planners on {scenario.name} ({len(scenario.devices)} devices)"
    if budget is not None and args.stages is None:
        # --sync auto: shoal's choice is the second policy; the baselines run under it (one pipeline)
        with console.status(what) as status:
            chosen = plan_auto(scenario, budget, seed=args.seed,
                               on_progress=lambda step: status.update(f"{what}: shoal's policy, {step}"))
        policy, replicas = chosen.sync, bool(chosen.replicas)
    exact = SyncPolicy(ordered=not getattr(args, "unordered_grads", False))  # as launch runs it
    policies = [("exact", exact)]
    if policy not in (SyncPolicy(), exact):
        label = f"local H={policy.sync_every}" if policy.local else "exact+codecs"
        if replicas:
            label += " replicas"
        policies.append((label, policy))
    rows = []
    with console.status(what) as status:
        for method in COMPARE_METHODS:
            for label, pol in policies:
                status.update(f"{what}: {method} under {label}")
                row = _compare_row(method, scenario, args, pol, simulate, label, replicas=replicas and pol.local)
                if row is not None:
                    rows.append(row)
    ok = [r for r in rows if "error" not in r]
    shoal_t = next((r["predicted_step_time_s"] for r in ok if r["method"] == "shoal" and r["policy"] == "exact"), None)
    if shoal_t is None:
        raise ShoalError(f"shoal found no plan for scenario {scenario.name}")
    codecs = f"act={policy.act_codec} grad={policy.grad_codec} push={policy.push_codec} pull={policy.pull_codec}"
    from rich.table import Table

    table = Table(title=f"planners on {scenario.name} (judged by shoal's cost model; all but shoal are baselines)"
                  + ("" if len(policies) == 1 else f"; second policy: {policies[1][0]}, {codecs}"))
    for col in ("method", "sync", "S", "used", "idle m/l/n/c", "pred step s", "pred tok/s", "pred FLOP%", "pred busy"):
        table.add_column(col, justify="right" if col not in ("method", "sync") else "left")
    if simulate is not None:
        for col in ("sim step s", "sim tok/s", "sim FLOP%", "sim busy"):
            table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["method"], r["policy"], *(["-"] * (len(table.columns) - 3)), "does not fit: " + r["error"][:40])
            continue
        r["ratio_to_shoal"] = r["predicted_step_time_s"] / shoal_t if shoal_t else None
        idle = r["idle_counts"]
        stages = str(r["stages"]) if r["replicas"] == 1 else f"{r['replicas']} replicas"
        cells = [r["method"], r["policy"], stages, f"{r['devices_used']}/{r['devices_available']}",
                 "/".join(str(idle[k]) for k in IDLE_REASONS), _fmt(r["predicted_step_time_s"]),
                 _tps(r.get("predicted_tokens_per_s")), _pct1(r.get("predicted_flop_share")),
                 _pct(r.get("predicted_utilisation"))]
        if simulate is not None:
            cells += [_fmt(r.get("simulated_step_time_s")), _tps(r.get("simulated_tokens_per_s")),
                      _pct1(r.get("simulated_flop_share")), _pct(r.get("simulated_utilisation"))]
        table.add_row(*cells)
    from rich.console import Console as _Console

    # a wide table: never squeezed below 132 columns (a narrow terminal wraps lines instead)
    _Console(width=max(console.width, 132), file=console.file).print(table)
    console.print("FLOP% = tokens/s as a share of the swarm's FLOP limit (all workers' FLOP/s / training FLOPs per "
                  "token); used = devices used / available; idle m/l/n/c = idle for memory / links / no benefit / server CPU; "
                  "busy = busy share of the used devices; S = stages (or replicas)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"scenario": scenario.name, "methods": rows}, indent=2) + "\n")
        console.print(f"comparison written to {args.json_out}")
    return 0
