"""Local-update sync benchmark: what the planner and simulator predict for DiLoCo-style sync.

Run from the repository root (one process, one thread):

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_local.py                # targets + agreement
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_local.py --targets      # table 1 only
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_local.py --agreement    # table 2 only
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_local.py --scale        # table 3 only

Prints markdown tables (also written to ``--out``):

1. targets -- gaming-world, scale-1024 and scale-4096 planned and simulated (no churn) under
   exact sync and under ``--sync local --sync-every 32 --compression int8`` (overlapped rounds,
   overlapped uploads; and with ``--overlap-io prefetch``): step time, compute utilisation,
   devices used, tokens/s;
2. agreement -- on every built-in scenario, shoal's local-mode plan (H = 8, int8): the cost
   model's step time against the simulated one over one round (H steps);
3. scale (``--scale``) -- gaming-world, scale-1024 and scale-4096 under ``--sync local
   --sync-every 32 --compression int8``, each planned once and simulated over a round
   compressed to 2 steps and over a whole round (32 steps): step time, compute utilisation,
   tokens/s, predicted / simulated, planner and simulator CPU seconds, and the ratio of
   simulated tokens/s scale-4096 / scale-1024.

Ratios within one run only: no timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")

from shoal.plan import BUILTIN_SCENARIOS, load_scenario, make_plan  # noqa: E402
from shoal.plan.compression import parse_compression  # noqa: E402
from shoal.plan.types import SyncPolicy  # noqa: E402
from shoal.sim import simulate  # noqa: E402

TARGETS = ("gaming-world", "scale-1024", "scale-4096")


def local_policy(h: int, spec: str = "int8", prefetch: bool = False) -> SyncPolicy:
    """``--sync local --sync-every h --compression spec`` with the CLI's defaults (overlapped
    rounds, overlapped uploads); ``prefetch`` as ``--overlap-io prefetch``."""
    c = parse_compression(spec)
    return SyncPolicy(mode="local", sync_every=h, act_codec=c["act"], grad_codec=c["grad"], push_codec=c["push"],
                      pull_codec=c["pull"], overlap=True, overlap_uploads=True, prefetch=prefetch)


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def compressed_round(policy: SyncPolicy, k: int) -> SyncPolicy:
    """``policy`` with its round shrunk to ``k`` steps: a round every ``k`` steps carrying
    ``k / H`` of the sync bytes (``grad_compression``). Per step it adds the same background
    bytes and the same share of a round's wait (a round that takes ``R`` against ``H`` steps of
    ``P`` waits ``max(0, R - H P)``, scaled by ``k / H``; only the round's 3 latencies do not
    scale), so ``k`` simulated steps stand for a round of ``H`` at ``k / H`` of the events."""
    if not policy.local or k >= policy.sync_every:
        return policy
    return replace(policy, sync_every=k, grad_compression=policy.grad_compression * k / policy.sync_every)


def run_one(name: str, policy: SyncPolicy, steps: int, round_steps: int = 0) -> dict:
    """Plan ``name`` for ``policy`` and simulate ``steps`` steps without churn; with
    ``round_steps`` = k, simulate the plan's placement for k steps under
    :func:`compressed_round` (the prediction stays that of the full policy)."""
    scn = load_scenario(name)
    t0 = time.perf_counter()
    plan = make_plan(scn, sync=policy)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    if round_steps and round_steps < policy.sync_every:
        sim_plan = replace(plan, sync=compressed_round(policy, round_steps))
        steps = round_steps
    else:
        sim_plan = plan
    res = simulate(sim_plan, scn, steps=steps, churn=False, seed=0)
    return {"scenario": name, "stages": plan.n_stages, "used": sum(len(s.workers) for s in plan.stages),
            "devices": len(scn.workers), "pred": plan.predicted["step_time_s"], "sim": res.mean_step_time_s,
            "pred_util": plan.predicted["utilisation"], "sim_util": res.mean_utilisation(),
            "tokens_s": res.tokens_per_s, "round_s": plan.predicted.get("sync_round_s", 0.0),
            "plan_s": t_plan, "sim_wall_s": time.perf_counter() - t0, "stalled": res.stalled}


def targets(h: int = 32) -> str:
    rows = []
    for name in TARGETS:
        for label, pol, steps in (("exact", SyncPolicy(), 2), (f"local H={h} int8", local_policy(h), h),
                                  (f"local H={h} int8 prefetch", local_policy(h, prefetch=True), h)):
            r = run_one(name, pol, steps)
            rows.append([name, label, str(r["stages"]), f"{r['used']}/{r['devices']}", f"{r['pred']:.2f}",
                         f"{r['sim']:.2f}", f"{r['pred'] / r['sim']:.3f}", f"{r['pred_util']:.1%}",
                         f"{r['sim_util']:.1%}", f"{r['tokens_s']:,.0f}", f"{r['round_s']:.0f}",
                         f"{r['plan_s']:.1f}", f"{r['sim_wall_s']:.1f}" + (" STALLED" if r["stalled"] else "")])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return _table(["scenario", "sync", "S", "devices used", "pred step s", "sim step s", "pred/sim", "pred util",
                   "sim util", "sim tokens/s", "round s", "plan s", "sim wall s"], rows)


SCALES = ("gaming-world", "scale-1024", "scale-4096")


def scale(h: int = 32, names=SCALES, round_steps=(2, 0)) -> str:
    """Local mode only (H = h, int8, the CLI defaults), simulated without churn: does tokens/s
    grow with the number of devices? Each scenario is planned once and its plan simulated once
    per entry of ``round_steps``: k > 0 simulates k steps of a round compressed to them (see
    :func:`compressed_round`), 0 the whole round (h steps). Ratios: simulated tokens/s of the
    last scenario over the one before it, per k; simulator CPU seconds per run."""
    policy = local_policy(h)
    rows = []
    got: dict[int, list[float]] = {k: [] for k in round_steps}
    for name in names:
        scn = load_scenario(name)
        c0, t0 = time.process_time(), time.perf_counter()
        plan = make_plan(scn, sync=policy)
        plan_cpu, plan_wall = time.process_time() - c0, time.perf_counter() - t0
        for k in round_steps:
            if 0 < k < h:
                sim_plan, steps, label = replace(plan, sync=compressed_round(policy, k)), k, f"{k} (round of {k})"
            else:
                sim_plan, steps, label = plan, h, f"{h} (whole round)"
            c0, t0 = time.process_time(), time.perf_counter()
            res = simulate(sim_plan, scn, steps=steps, churn=False, seed=0)
            sim_cpu, sim_wall = time.process_time() - c0, time.perf_counter() - t0
            pred, sim = plan.predicted["step_time_s"], res.mean_step_time_s
            got[k].append(res.tokens_per_s)
            rows.append([name, label, str(plan.n_stages), f"{sum(len(s.workers) for s in plan.stages)}/{len(scn.workers)}",
                         f"{pred:.2f}", f"{sim:.2f}", f"{pred / sim:.3f}", f"{plan.predicted['utilisation']:.1%}",
                         f"{res.mean_utilisation():.1%}", f"{res.tokens_per_s * sim / pred:,.0f}",
                         f"{res.tokens_per_s:,.0f}", f"{res.events:,}", f"{plan_cpu:.1f} ({plan_wall:.0f})",
                         f"{sim_cpu:.1f} ({sim_wall:.0f})" + (" STALLED" if res.stalled else "")])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    text = _table(["scenario", "steps simulated", "S", "devices used", "pred step s", "sim step s", "pred/sim",
                   "pred util", "sim util", "pred tokens/s", "sim tokens/s", "sim events", "plan CPU s (wall)",
                   "sim CPU s (wall)"], rows)
    if len(names) > 1:
        for k, t in got.items():
            text += (f"\n\nsteps simulated {k or h}: sim tokens/s {names[-1]} / {names[-2]} = {t[-1] / t[-2]:.2f}"
                     f" ({t[-2]:,.0f} -> {t[-1]:,.0f}): " + ("grows" if t[-1] > t[-2] else "does NOT grow"))
    return text


def agreement(h: int = 8, names=BUILTIN_SCENARIOS, round_steps: int = 0) -> str:
    rows = []
    for name in names:
        r = run_one(name, local_policy(h), h, round_steps)
        rows.append([name, str(r["stages"]), f"{r['used']}/{r['devices']}", f"{r['pred']:.3f}", f"{r['sim']:.3f}",
                     f"{r['pred'] / r['sim']:.3f}", f"{r['pred_util']:.1%}", f"{r['sim_util']:.1%}",
                     f"{r['sim_wall_s']:.1f}"])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return _table(["scenario", "S", "devices used", "pred step s", "sim step s", "pred/sim", "pred util", "sim util",
                   "sim wall s"], rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", action="store_true", help="table 1 only")
    ap.add_argument("--agreement", action="store_true", help="table 2 only")
    ap.add_argument("--scale", action="store_true",
                    help="table 3 only: local mode on gaming-world, scale-1024 and scale-4096, a round of 2 and a whole round")
    ap.add_argument("--scenarios", default=None,
                    help="comma-separated scenarios for --agreement or --scale (default: all built-ins / both scales)")
    ap.add_argument("--round-steps", type=int, default=0,
                    help="--scale, --agreement: simulate this many steps of a round compressed to them "
                         "(default: the whole round; --scale: both 2 and the whole round)")
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = ap.parse_args()
    names = args.scenarios.split(",") if args.scenarios else None
    both = not (args.targets or args.agreement or args.scale)
    parts = []
    if args.scale:
        ks = (args.round_steps,) if args.round_steps else (2, 0)
        parts.append("## 3. Scale: local sync (H = 32, int8), simulated without churn\n\n"
                     + scale(names=names or SCALES, round_steps=ks))
    if args.targets or both:
        parts.append("## 1. Targets: exact vs local sync (H = 32, int8), simulated without churn\n\n" + targets())
    if args.agreement or both:
        parts.append("## 2. Cost model vs simulator, local mode (H = 8, int8, one round), shoal's plans\n\n"
                     + agreement(names=names or BUILTIN_SCENARIOS, round_steps=args.round_steps))
    text = "\n\n".join(parts) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
