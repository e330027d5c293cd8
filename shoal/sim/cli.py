"""``shoal simulate``: replay a plan on a scenario and compare it with the cost model."""

from __future__ import annotations

import argparse
import json

from shoal.errors import ShoalError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a plan event by event on a scenario (step time, tokens/s, utilisation, churn)",
        description="Simulate training steps of a plan on a scenario with the discrete-event simulator "
                    "and compare the simulated step time with the cost model's prediction.",
    )
    p.add_argument("--scenario", required=True, help="built-in scenario name or scenario JSON file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--method", default="shoal", help="planner to make the plan with (default: shoal)")
    src.add_argument("--plan", help="plan JSON file (from `shoal plan --json`) instead of planning")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps to simulate (default 3; local mode: --sync-every, one round)")
    p.add_argument("--churn", choices=("on", "off"), default="off",
                   help="devices leave and rejoin per the scenario's sessions or trace (default off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the planner and of the churn (default 0)")
    p.add_argument("--lease-timeout", type=float, default=None,
                   help="seconds before a vanished worker's tasks are re-queued (default 10)")
    p.add_argument("--straggler", action="append", default=[], metavar="DEVICE:START:DURATION:FACTOR",
                   help="slow DEVICE down FACTOR times from START for DURATION simulated seconds (repeatable)")
    p.add_argument("--server-failure", action="append", default=[], metavar="STAGE:TIME:RECOVERY",
                   help="stage STAGE's server host dies at TIME and is back RECOVERY seconds later (repeatable)")
    p.add_argument("--json", metavar="OUT", help="write the full result as JSON to OUT")
    from shoal.plan.cli import add_sync_arguments

    add_sync_arguments(p)
    p.add_argument("--timeline", metavar="OUT.png", help="draw a per-device timeline (small plans only)")
    p.set_defaults(func=run)


def parse_straggler(text: str):
    """``DEVICE:START:DURATION:FACTOR`` -> :class:`Straggler` (the device id may contain colons)."""
    from shoal.sim import Straggler

    parts = text.rsplit(":", 3)
    try:
        dev, start, dur, fac = parts[0], float(parts[1]), float(parts[2]), float(parts[3])
    except (IndexError, ValueError):
        raise ShoalError(f"--straggler {text!r}: expected DEVICE:START:DURATION:FACTOR, e.g. eu-0:0:60:10") from None
    if start < 0 or dur <= 0 or fac <= 0:
        raise ShoalError(f"--straggler {text!r}: START must be >= 0, DURATION and FACTOR positive")
    return Straggler(dev, start, dur, fac)


def parse_server_failure(text: str):
    """``STAGE:TIME:RECOVERY`` -> :class:`ServerFailure`."""
    from shoal.sim import ServerFailure

    try:
        stage, t, rec = text.split(":")
        out = ServerFailure(float(t), int(stage), float(rec))
    except ValueError:
        raise ShoalError(f"--server-failure {text!r}: expected STAGE:TIME:RECOVERY, e.g. 1:30:20") from None
    if out.time_s < 0 or out.recovery_s <= 0:
        raise ShoalError(f"--server-failure {text!r}: TIME must be >= 0 and RECOVERY positive")
    return out


def _load(args):
    from shoal.plan import load_scenario, make_plan
    from shoal.plan.auto import plan_auto
    from shoal.plan.cli import auto_applies, budget_from_args, policy_from_args
    from shoal.plan.types import Plan, SyncPolicy

    scenario = load_scenario(args.scenario)
    policy = policy_from_args(args)
    budget = budget_from_args(args)
    if args.plan:
        plan = Plan.from_json(args.plan)
        if plan.scenario != scenario.name:
            raise ShoalError(f"plan {args.plan} was made for scenario {plan.scenario}, not {scenario.name}; "
                             "pass the matching --scenario")
        if policy != SyncPolicy():
            plan.sync = policy  # the flags override the plan file's policy
    else:
        from rich.console import Console

        # (on a terminal, a status line on stderr while a large swarm is planned; nothing otherwise)
        what = f"planning {scenario.name} ({len(scenario.devices)} devices)"
        with Console(stderr=True).status(what) as status:
            if budget is not None and auto_applies(args):
                plan = plan_auto(scenario, budget, seed=args.seed,
                                 on_progress=lambda step: status.update(f"{what}: {step}"))
            else:
                plan = make_plan(scenario, method=args.method, seed=args.seed, sync=policy,
                                 replicas=getattr(args, "replicas", False))
    return scenario, plan


def summary_lines(result, predicted: float | None) -> list[str]:
    """Human-readable summary of a :class:`SimResult` (one fact per line)."""
    lines = [
        f"scenario {result.scenario}, method {result.method}, {result.steps} steps"
        + (", churn on" if result.churn else ""),
        f"simulated step time   {result.mean_step_time_s:10.3f} s  (per step: "
        + ", ".join(f"{t:.3f}" for t in result.step_times_s[:8]) + (" ..." if result.steps > 8 else "") + ")",
    ]
    if predicted:
        lines.append(f"cost-model prediction {predicted:10.3f} s  (predicted / simulated = "
                     f"{predicted / result.mean_step_time_s:.3f})")
    lines += [
        f"tokens/s              {result.tokens_per_s:10.1f}",
        f"busy share            {result.mean_utilisation():10.3f}  (of the used devices: fraction of time computing)",
        f"re-queued tasks       {result.requeued_tasks:10d}  (recomputes {result.recomputes}, "
        f"leaves {result.leaves}, joins {result.joins})",
        f"lost micro-batches    {result.lost_micro_batches:10d}",
        f"events                {result.events:10d}  in {result.wall_time_s:.2f} s wall "
        f"({result.events_per_s:,.0f} events/s)",
    ]
    if result.stalled:
        lines.append("WARNING: the run stalled before finishing its steps (a stage without workers?)")
    return lines


def swarm_lines(plan, scenario, result) -> list[str]:
    """The swarm figures of the simulated run, then the cost model's: tokens/s as a share of the
    swarm's FLOP limit, devices used / available, and why the idle devices are idle."""
    from shoal.plan.replicas import judged_report

    pred, what_if = judged_report(plan, scenario)
    sim = judged_report(plan, scenario, step_s=result.mean_step_time_s, busy_share=result.mean_utilisation(),
                        what_if=what_if)[0]
    lines = [f"simulated:  {sim.summary()}", f"cost model: {pred.summary()}"]
    by_reason: dict[str, list[str]] = {}
    for dev, reason in sorted(sim.idle.items()):
        by_reason.setdefault(reason, []).append(dev)
    for reason, devs in by_reason.items():
        lines.append(f"  idle for {reason}: {len(devs)}; e.g. {devs[0]}: {sim.why[devs[0]]}")
    return lines


def run(args: argparse.Namespace) -> int:
    from shoal.plan.cost import predict
    from shoal.sim import SimConfig, plot_timeline, simulate

    if args.steps is not None and args.steps <= 0:
        raise ShoalError(f"--steps must be positive, got {args.steps}")
    scenario, plan = _load(args)
    if args.steps is None:
        args.steps = plan.sync.sync_every if plan.sync.local else 3
    pred = predict(plan, scenario)
    predicted = pred["step_time_s"]
    cfg = SimConfig() if args.lease_timeout is None else SimConfig(lease_timeout_s=args.lease_timeout)
    stragglers = [parse_straggler(t) for t in args.straggler]
    failures = [parse_server_failure(t) for t in args.server_failure]
    result = simulate(plan, scenario, steps=args.steps, churn=args.churn == "on", seed=args.seed,
                      record_timeline=bool(args.timeline), stragglers=stragglers,
                      server_failures=failures, config=cfg)
    result.predicted_step_time_s = predicted
    for line in summary_lines(result, predicted):
        print(line)
    print(f"cost-model busy share  {pred.get('utilisation', 0.0):9.3f}  (of the used devices; sync: "
          + (f"local, a round every {plan.sync.sync_every} steps" if plan.sync.local else "exact")
          + (f", {len(plan.replicas)} pipeline replicas" if plan.replicas else "") + ")")
    for line in swarm_lines(plan, scenario, result):
        print(line)
    if args.json:
        d = result.to_dict()
        d["plan"] = plan.to_dict()
        with open(args.json, "w") as f:
            json.dump(d, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    if args.timeline:
        if result.timeline is None:
            raise ShoalError(f"--timeline is only drawn for plans with at most {cfg.timeline_max_devices} workers; "
                             f"this one has {sum(len(s.workers) for s in plan.stages)}")
        plot_timeline(result, args.timeline)
        print(f"wrote {args.timeline}")
    return 1 if result.stalled or result.lost_micro_batches else 0
