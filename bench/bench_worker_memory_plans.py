"""What the planner's swarm figures become with another count of a worker's memory: what a runtime
that held less (or more) per parameter would buy.

    PYTHONPATH=. python bench/bench_worker_memory_plans.py [--scenarios gaming-world,gaming-eu,scale-1024]
        [--bytes 8]

The planner counts what a worker holds (``ModelProfile.worker_memory``: fp32 weights under
autocast, the task's fp32 gradient and the step's sum, ``WORKER_BYTES_PER_PARAM`` = 12 bytes a
parameter, + one micro-batch's saved activations; until 2026-12-06 it counted 4 at fp16, which
is how bench/results/worker-memory.md's 09:29 table compares them). For each scenario this plans
``--sync auto`` twice, as the planner does and with ``worker_memory`` = ``--bytes`` x parameters +
saved activations (the inner AdamW state is added on top in local mode either way), and prints
each plan's share of the swarm's FLOP limit, the devices it uses and its shape.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager


@contextmanager
def worker_bytes(per_param: float | None):
    """``ModelProfile.worker_memory`` as ``per_param`` x parameters + saved activations (None: as is)."""
    from shoal.model import profile
    from shoal.plan import allocator

    original = profile.ModelProfile.worker_memory
    allocator._PAIR_CACHE.clear()  # (each layer range's worker memory, memoised per profile)
    if per_param is not None:
        def honest(self, first: int, last: int) -> int:
            return int(per_param * self.params(first, last) + self.saved_act_bytes(first, last))

        profile.ModelProfile.worker_memory = honest
    try:
        yield
    finally:
        profile.ModelProfile.worker_memory = original
        allocator._PAIR_CACHE.clear()


def main() -> None:
    from shoal.plan import load_scenario
    from shoal.plan.auto import plan_auto
    from shoal.plan.report import swarm_report

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="gaming-world,gaming-eu,scale-1024")
    ap.add_argument("--bytes", type=float, default=8.0, help="bytes a parameter a worker would hold (the runtime: 12)")
    args = ap.parse_args()
    print("| scenario | worker memory | share of the FLOP limit | devices used | replicas | stages a replica | sync |")
    print("|---|---|---|---|---|---|---|")
    for name in args.scenarios.split(","):
        for label, per in (("as planned now", None), (f"{args.bytes:g} B a parameter", args.bytes)):
            with worker_bytes(per):
                s = load_scenario(name)
                plan = plan_auto(s)
                rep = swarm_report(plan, s)
            shapes = sorted({len(r.stages) for r in plan.pipelines})
            sync = f"local, H = {plan.sync.sync_every}" if plan.sync.local else "exact"
            print(f"| {name} | {label} | {rep.flop_share:.1%} | {rep.devices_used}/{rep.devices_available} | "
                  f"{len(plan.pipelines)} | {', '.join(map(str, shapes))} | {sync} |", flush=True)


if __name__ == "__main__":
    main()
