"""Honest per-micro-batch gradient statistics, per stage: what the push screen's thresholds
(shoal.runtime.safety.guard.GuardConfig) must tolerate without flagging.

Trains a model with the runtime's own micro-batches and AdamW (one process, fp32), and
prints per stage and step: max/min per-micro-batch gradient norm within the step, the
norm relative to the median of the previous pushes (the screen's centre), and the lowest
cosine of a micro-batch gradient to the previous step's full gradient.

    python bench/bench_screen.py --model tiny --steps 20 --data synthetic
"""

from __future__ import annotations

import argparse
import math
import statistics

from shoal.model.transformer import build_stage
from shoal.net import shoal_pb2 as pb
from shoal.runtime.common import micro_batch, model_config, optim_config, set_threads
from shoal.runtime.roles.coordinator import plan_stages
from shoal.runtime.safety.verify import dot, sq_norm
from shoal.train.optim import apply_update, lr_at, make_optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--data", default="synthetic")
    ap.add_argument("--stages", type=int, default=2)
    args = ap.parse_args()
    set_threads()
    spec = pb.RunSpec(model=args.model, stages=args.stages, steps=args.steps, micro_batches=args.micro_batches,
                      micro_batch_size=2, seq_len=32, seed=3, lr=3e-3, min_lr=3e-4, warmup=2, weight_decay=0.1,
                      grad_clip=1.0, data=args.data)
    cfg = model_config(spec)
    n = cfg.n_total_layers
    layers = plan_stages(n, args.stages)  # the runtime's stage split
    model = build_stage(cfg, 0, n, seed=spec.seed)
    opt = make_optimizer(model.named_parameters(), optim_config(spec))
    names = [k for k, _ in model.named_parameters()]

    def stage_of(name: str) -> int:
        layer = int(name.split(".")[1])  # "layers.<global layer index>.<...>"
        return next(s for s, (a, b) in enumerate(layers) if a <= layer < b)

    groups = {s: [k for k in names if stage_of(k) == s] for s in range(args.stages)}
    hist: dict[int, list[float]] = {s: [] for s in groups}
    prev: dict[int, dict] = {}
    worst = {s: [1.0, math.inf, 1.0] for s in groups}  # max ratio to centre, min ratio, min cosine
    print(f"{'step':>4} {'stage':>5} {'max/min in step':>15} {'max vs centre':>13} {'min vs centre':>13} {'min cos':>8}")
    for step in range(args.steps):
        per_mb = []
        for mb in range(args.micro_batches):
            x, y = micro_batch(spec, step, mb)
            model.zero_grad(set_to_none=True)
            (model(x, y) / args.micro_batches).backward()
            per_mb.append({k: p.grad.clone() for k, p in model.named_parameters()})
        for s, keys in groups.items():
            gs = [{k: g[k] for k in keys} for g in per_mb]
            norms = [math.sqrt(sq_norm(g)) for g in gs]
            centre = statistics.median(hist[s]) if hist[s] else None
            cos = None
            if s in prev:
                pn = math.sqrt(sq_norm(prev[s]))
                cos = min(dot(g, prev[s]) / (nm * pn) for g, nm in zip(gs, norms, strict=True))
            hi = max(norms) / centre if centre else float("nan")
            lo = min(norms) / centre if centre else float("nan")
            if centre:
                worst[s][0] = max(worst[s][0], hi)
                worst[s][1] = min(worst[s][1], lo)
            if cos is not None:
                worst[s][2] = min(worst[s][2], cos)
            print(f"{step:>4} {s:>5} {max(norms) / min(norms):>15.2f} {hi:>13.2f} {lo:>13.2f} "
                  f"{'-' if cos is None else f'{cos:.2f}':>8}")
            hist[s] = (hist[s] + norms)[-32:]
            prev[s] = {k: sum(g[k] for g in gs) for k in keys}
        for p, k in zip(model.parameters(), names, strict=True):
            p.grad = sum(g[k] for g in per_mb)
        total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        coef = min(1.0, spec.grad_clip / (total + 1e-6))
        apply_update(opt, lr_at(step, args.steps, optim_config(spec)), coef)
    print("\nworst over the run, per stage: max norm / centre, min norm / centre, min cosine to the last step")
    for s, (hi, lo, cos) in worst.items():
        print(f"stage {s}: {hi:.2f}  {lo:.2f}  {cos:.2f}")


if __name__ == "__main__":
    main()
