"""How much of a swarm's FLOPs each sync policy turns into training, planned and simulated.

Run from the repository root (one process, one thread):

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_swarm_share.py                 # the four targets
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_swarm_share.py --scenarios gaming-eu demo
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_swarm_share.py --out bench/results/swarm-share.md
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_swarm_share.py --agreement      # replicas on every built-in
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_swarm_share.py --policies auto --host-memory-gb 256  # what-if
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_swarm_share.py --policies auto --host-cores-x 8  # what-if
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_swarm_share.py --policies auto --no-reference --host-memory-gb 256

Per scenario and policy: devices used / available, idle devices by reason (memory / links / no
benefit), the predicted and the simulated tokens/s and their share of the swarm's FLOP limit
(sum of every worker's FLOP/s / the model's training FLOPs per token, shoal.plan.report), and
predicted / simulated step. Policies:

* ``exact`` -- exact sync with one summed push per worker a step (``shoal plan --sync exact
  --unordered-grads``, as ``shoal launch --unordered-grads`` and ``shoal demo`` run it);
* ``exact ordered`` -- exact sync as ``shoal launch`` runs it by default for bitwise parity (a
  worker of a shared stage pushes each micro-batch's gradient alone; ``shoal plan --sync exact``);
* ``local int8`` -- ``--sync local --sync-every 32 --compression int8``, one pipeline;
* ``local sparse`` -- the same with ``push=sparse,pull=sparse,act=int8,grad=int8``;
* ``replicas sparse`` -- ``--replicas`` with the same codecs: pipeline replicas inside network
  clusters, of the stage count each device's memory needs;
* ``local lowrank``, ``replicas lowrank`` -- the same with ``push=lowrank,pull=lowrank``;
* ``replicas lean lowrank`` -- ``replicas lowrank`` with lean workers (``--lean-workers``: 12
  bytes a parameter, docs/lean-workers.md);
* ``auto`` -- ``--sync auto`` under the default quality budget (what ``shoal plan`` picks);
* ``auto, rounds waited for`` -- the same plan with the steps waiting for each round
  (``overlap=False``, the runtime's ``--no-overlap``; by default it overlaps them,
  docs/delayed-application.md).

Local policies are simulated over rounds compressed to 2 steps (``bench_local.compressed_round``:
the round carries 2/32 of its bytes, so each step carries the same background bytes and share of
the round's wait); with ``--rounds R`` > 1, R such rounds and the mean of the second half's
steps (a round's merge cannot start before the screen's reference gradient, which the first step
after the previous merge starts, so merges that take longer than a round drift later round by
round before the steps wait for them); exact sync over 2 steps. Then the simulated tokens/s of scale-4096 over
scale-1024 per policy. ``--agreement`` runs ``replicas sparse`` and ``replicas lean lowrank`` on
every built-in scenario (the cost model against the simulator). Ratios within one run only: no timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_local import compressed_round  # noqa: E402

from shoal.plan import load_scenario, make_plan  # noqa: E402
from shoal.plan.compression import parse_compression  # noqa: E402
from shoal.plan.replicas import judged_report  # noqa: E402
from shoal.plan.report import IDLE_REASONS  # noqa: E402
from shoal.plan.types import SyncPolicy  # noqa: E402
from shoal.sim import simulate  # noqa: E402

TARGETS = ("gaming-world", "gaming-eu", "scale-1024", "scale-4096")
H = 32


def local(spec: str, uploads: bool = True, lean: bool = False) -> SyncPolicy:
    c = parse_compression(spec)
    return SyncPolicy(mode="local", sync_every=H, act_codec=c["act"], grad_codec=c["grad"], push_codec=c["push"],
                      pull_codec=c["pull"], overlap=True, overlap_uploads=uploads, lean=lean)


SPARSE = "act=int8,grad=int8,push=sparse,pull=sparse"
LOWRANK = "act=int8,grad=int8,push=lowrank,pull=lowrank"  # rank 3, 4 bits: 1,313x fewer bytes than bf16 at gpt-1.3b's width
TERN = "act=tern,grad=tern,push=sparse,pull=sparse"  # activations in tern (9.28x fewer bytes than bf16)


def policies() -> list[tuple[str, SyncPolicy | str | None, bool]]:
    """(label, policy, replicas); policy None = --sync auto; "wait" = its plan with the steps
    waiting for each round (``overlap=False``: the runtime's ``--no-overlap``)."""
    return [("exact", SyncPolicy(), False), ("exact ordered", SyncPolicy(ordered=True), False),
            ("local int8", local("int8"), False),
            ("local sparse", local(SPARSE), False), ("replicas sparse", local(SPARSE, uploads=False), True),
            ("local lowrank", local(LOWRANK), False), ("replicas lowrank", local(LOWRANK, uploads=False), True),
            ("replicas tern", local(TERN, uploads=False), True),
            ("replicas lean lowrank", local(LOWRANK, uploads=False, lean=True), True), ("auto", None, False),
            ("auto, rounds waited for", "wait", False)]


def run_one(name: str, label: str, policy: SyncPolicy | str | None, replicas: bool, sim_steps: int = 2,
            rounds: int = 1, host_memory_gb: float | None = None, host_cores_x: int = 1) -> dict:
    scn = load_scenario(name)
    if host_memory_gb is not None or host_cores_x != 1:  # (what-if: every server host with this much RAM, cores)
        scn = replace(scn, devices=[
            replace(d, host_memory=d.host_memory if host_memory_gb is None else host_memory_gb * 1e9,
                    cores=d.cores * host_cores_x) if d.can_host_server else d for d in scn.devices])
    t0 = time.process_time()
    if policy is None or policy == "wait":
        from shoal.plan.auto import QualityBudget, plan_auto
        from shoal.plan.cost import predict

        plan = plan_auto(scn, QualityBudget())
        if policy == "wait":
            plan = replace(plan, sync=replace(plan.sync, overlap=False))
            plan.predicted = predict(plan, scn)
    else:
        plan = make_plan(scn, sync=policy, replicas=replicas)
    t_plan = time.process_time() - t0
    # (devices no host has server memory for: idle for memory only if the planner's plan with
    # that memory uses them and is faster, shoal.plan.replicas.memory_what_if)
    pred, what_if = judged_report(plan, scn)
    t0 = time.process_time()
    sim_plan = replace(plan, sync=compressed_round(plan.sync, sim_steps)) if plan.sync.local else plan
    steps = sim_steps * rounds if plan.sync.local else sim_steps
    res = simulate(sim_plan, scn, steps=steps, churn=False, seed=0)
    t_sim = time.process_time() - t0
    late = res.step_times_s[steps // 2:] if plan.sync.local and rounds > 1 else res.step_times_s
    step_s = sum(late) / len(late)
    sim = judged_report(plan, scn, step_s=step_s, busy_share=res.mean_utilisation(), what_if=what_if)[0]
    shape = f"{len(plan.replicas)} replicas" if plan.replicas else f"S={plan.n_stages}"
    pol = plan.sync
    desc = "exact" if not pol.local else (f"local H={pol.sync_every} push={pol.push_codec} act={pol.act_codec}"
                                          + (" lean" if pol.lean else ""))
    return {"scenario": name, "policy": label, "chosen": desc, "shape": shape, "used": pred.devices_used,
            "devices": pred.devices_available, "idle": pred.idle_counts(), "pred_tps": pred.tokens_per_s,
            "pred_share": pred.flop_share, "sim_tps": sim.tokens_per_s, "sim_share": sim.flop_share,
            "pred_step": plan.predicted["step_time_s"], "sim_step": step_s, "plan_cpu_s": t_plan,
            "sim_cpu_s": t_sim, "stalled": res.stalled, "lost": res.lost_micro_batches}


def table(rows: list[dict]) -> str:
    head = ["scenario", "policy", "shape", "used / avail", "idle m/l/n/c", "pred tokens/s", "pred % FLOP limit",
            "sim tokens/s", "sim % FLOP limit", "pred / sim step", "plan CPU s", "sim CPU s"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        label = r["policy"] if r["policy"] != "auto" else f"auto ({r['chosen']})"
        out.append("| " + " | ".join([
            r["scenario"], label, r["shape"], f"{r['used']}/{r['devices']}",
            "/".join(str(r["idle"][k]) for k in IDLE_REASONS), f"{r['pred_tps']:,.0f}", f"{r['pred_share']:.1%}",
            f"{r['sim_tps']:,.0f}", f"{r['sim_share']:.1%}", f"{r['pred_step'] / r['sim_step']:.3f}",
            f"{r['plan_cpu_s']:.1f}", f"{r['sim_cpu_s']:.1f}"]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=list(TARGETS))
    ap.add_argument("--policies", nargs="+", default=None, help="labels to run (default: all)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--agreement", action="store_true",
                    help="replicas sparse and replicas lean lowrank on every built-in scenario")
    ap.add_argument("--rounds", type=int, default=1, help="compressed rounds a local policy is simulated for")
    ap.add_argument("--host-memory-gb", type=float, default=None,
                    help="give every server host this much RAM (default: the scenario's): is host memory what binds?")
    ap.add_argument("--host-cores-x", type=int, default=1,
                    help="give every server host this many times its cores: is the servers' CPU what binds?")
    ap.add_argument("--no-reference", action="store_true",
                    help="what-if: plan and simulate as if the screen's reference gradient cost nothing "
                         "(shoal.plan.cost.SCREEN_REF_TOKENS = 0; the runtime still computes it)")
    args = ap.parse_args(argv)
    if args.no_reference:
        import shoal.plan.cost as cost

        cost.SCREEN_REF_TOKENS = 0
    if args.agreement:
        from shoal.plan import BUILTIN_SCENARIOS

        args.scenarios, args.policies = list(BUILTIN_SCENARIOS), ["replicas sparse", "replicas lean lowrank"]
    rows = []
    for name in args.scenarios:
        for label, pol, reps in policies():
            if args.policies and label not in args.policies:
                continue
            r = run_one(name, label, pol, reps, rounds=args.rounds, host_memory_gb=args.host_memory_gb,
                        host_cores_x=args.host_cores_x)
            rows.append(r)
            print(table([r]).splitlines()[-1], flush=True)
    text = table(rows)
    by = {(r["scenario"], r["policy"]): r for r in rows}
    ratios = []
    for label, _, _ in policies():
        a, b = by.get(("scale-1024", label)), by.get(("scale-4096", label))
        if a and b:
            ratios.append(f"- {label}: simulated tokens/s scale-4096 / scale-1024 = {b['sim_tps'] / a['sim_tps']:.2f} "
                          f"(predicted {b['pred_tps'] / a['pred_tps']:.2f})")
    if ratios:
        text += "\n\n" + "\n".join(ratios)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
