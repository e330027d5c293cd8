"""How many tokens the local-mode screen's reference gradient needs: honest and flipped
pseudo-gradients' cosines to the server's own gradient at several token budgets.

Trains a model on the bundled text in one process (fp32, AdamW, the runtime's formulas),
and every ``--every`` steps plays a local-mode round: from the current weights (the merged
weights), ``--replicas`` replicas each take ``--h`` inner AdamW steps on micro-batches of
their own; the server's reference gradient at the merged weights is computed on the round's
first step's micro-batches within each token budget (``reference_inputs``: whole micro-batches,
then a causal prefix). Prints, per budget, the honest cosines' minimum and mean, and the
lowest honest cosine over the ban threshold's magnitude (``GuardConfig.local_ref_ban``): a
flipped pseudo-gradient has exactly minus an honest one's cosine, so it is banned when that
cosine is above the threshold, and held out of the merge otherwise.

    python bench/bench_screen_reference.py --steps 60 --every 10 --budgets 4096,1024,256,64
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=60, help="training steps (a round is played every --every)")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--h", type=int, default=4, help="inner steps of a replica per round")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches a step (each replica's own)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--budgets", default="4096,1024,256,64", help="reference token budgets, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--whole", action="store_true",
                    help="whole micro-batches first (else the budget is spread over them as causal prefixes)")
    ap.add_argument("--ref-data", choices=["first", "merged"], default="first",
                    help="the reference's micro-batches: the round's first step (the replicas train on them) or "
                         "the step the merged weights last trained on (as the runtime: the step it merged)")
    ap.add_argument("--speed", metavar="MODEL", default=None,
                    help="instead: time the reference of a 4-block stage of MODEL at 4 micro-batches of 1 x 1024 "
                         "tokens within SCREEN_REF_TOKENS, in one thread and in one thread a micro-batch")
    args = ap.parse_args(argv)
    if args.speed:
        return speed(args.speed)

    import torch

    from shoal.data import get_micro_batch, load_data
    from shoal.model.transformer import build_stage
    from shoal.net import shoal_pb2 as pb
    from shoal.plan.types import SCREEN_REF_MBS
    from shoal.runtime.safety.guard import GuardConfig
    from shoal.runtime.safety.verify import reference_cosines, reference_gradient, reference_inputs
    from shoal.train.config import TrainConfig
    from shoal.train.optim import apply_update, lr_at, make_optimizer

    torch.set_num_threads(1)
    m, b, t = args.micro_batches, args.micro_batch_size, args.seq_len
    cfg = TrainConfig(model=args.model, steps=args.steps, micro_batches=m, micro_batch_size=b, seq_len=t,
                      seed=args.seed, lr=3e-3, warmup=5)
    mc = cfg.model_config()
    data = load_data(cfg.data_config(), mc.vocab_size)
    optim = cfg.optim_config()
    spec = pb.RunSpec(model=args.model, stages=1, steps=args.steps, micro_batches=m, micro_batch_size=b, seq_len=t,
                      seed=args.seed, data="corpus")  # the bundled text, as load_data reads it here
    budgets = [int(x) for x in args.budgets.split(",")]
    from shoal.runtime.common import micro_batch

    micro_batch(spec, 0, 0)  # (opens the text the reference reads, outside the timings)
    ban = GuardConfig().local_ref_ban

    def batch(step: int, i: int):
        return get_micro_batch(data, "train", args.seed, step, i, b, t)

    def train_step(model, opt, step: int, mbs: list[int], lr: float) -> None:
        for i in mbs:
            x, y = batch(step, i)
            (model(x, y) / len(mbs)).backward()
        apply_update(opt, lr, 1.0)

    model = build_stage(mc, 0, mc.n_total_layers, args.seed)
    opt = make_optimizer(model.named_parameters(), optim)
    cos: dict[int, list[float]] = {k: [] for k in budgets}
    secs: dict[int, list[float]] = {k: [] for k in budgets}
    for step in range(args.steps):
        if step % args.every == 0 and step > 0:
            # a round from the merged weights: each replica its own micro-batches of H steps
            anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
            deltas = {}
            for r in range(args.replicas):
                rep = build_stage(mc, 0, mc.n_total_layers, args.seed)
                rep.load_state_dict(model.state_dict())
                ropt = make_optimizer(rep.named_parameters(), optim)
                for h in range(args.h):
                    s = 10_000 + step * 100 + h  # data no other round or the trunk sees
                    train_step(rep, ropt, s, [r * m + i for i in range(m)], lr_at(step, args.steps, optim))
                deltas[f"w{r}"] = {n: anchor[n] - p.detach() for n, p in rep.named_parameters()}
            if args.ref_data == "first":  # the round's first step: every replica's micro-batches
                # (in the order of the micro-batch numbers: the replicas' in turn, as leases spread them)
                held = [(r * m + i, None, None) for i in range(m) for r in range(args.replicas)]
                first = 10_000 + step * 100
            else:  # the step the merged weights were last trained on
                held, first = [(i, None, None) for i in range(m)], step - 1
            for k in budgets:
                t0 = time.perf_counter()
                ref = reference_gradient(model, spec, first, reference_inputs(held, b, t, SCREEN_REF_MBS, k, not args.whole),
                                         first=True, last=True)
                secs[k].append(time.perf_counter() - t0)
                cos[k].extend(c for c in reference_cosines(ref, deltas).values() if c is not None)
        train_step(model, opt, step, list(range(m)), lr_at(step, args.steps, optim))

    print(f"{args.model}, micro-batches {b} x {t} tokens, H = {args.h}, {args.replicas} replicas, "
          f"rounds every {args.every} of {args.steps} steps, reference on the {args.ref_data} step's "
          f"micro-batches ({'whole first' if args.whole else 'spread'}); ban below -{ban}")
    print("| reference tokens | honest cosines: min | mean | flips banned (min / ban threshold) | s a reference |")
    print("|---|---|---|---|---|")
    for k in budgets:
        c = cos[k]
        print(f"| {k} | {min(c):.4f} | {statistics.fmean(c):.4f} | {min(c) / ban:.2f}x "
              f"({sum(x > ban for x in c)}/{len(c)}) | {statistics.fmean(secs[k]):.3f} |")
    return 0


def speed(model: str) -> int:
    """The reference's FLOP rate on this host, as the server runs it: one thread, and one thread
    a micro-batch (``shoal.runtime.sync.local.reference_pool``), summed as autograd makes each
    parameter's gradient."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.model.transformer import build_stage
    from shoal.net import shoal_pb2 as pb
    from shoal.plan.types import SCREEN_REF_MBS, SCREEN_REF_TOKENS
    from shoal.runtime.safety.verify import reference_gradient, reference_inputs

    torch.set_num_threads(1)
    cfg = get_preset(model)
    a, b, t = 1, 5, 1024
    module = build_stage(cfg, a, b)
    prof = profile_model(cfg, t, 1)
    spec = pb.RunSpec(model=model, stages=2, steps=1, micro_batches=SCREEN_REF_MBS, micro_batch_size=1, seq_len=t,
                      seed=0, data="synthetic")
    g = torch.Generator().manual_seed(0)
    held = [(mb, torch.randn(1, t, cfg.d_model, generator=g), torch.randn(1, t, cfg.d_model, generator=g))
            for mb in range(SCREEN_REF_MBS)]
    inputs = reference_inputs(held, 1, t, SCREEN_REF_MBS, SCREEN_REF_TOKENS)
    tokens = sum(p for *_, p in inputs)
    flops = (prof.fwd_flops(a, b) + prof.bwd_flops(a, b)) / t * tokens
    print(f"{model} layers [{a}, {b}), {len(inputs)} micro-batches x {inputs[0][3]} tokens, {os.cpu_count()} cores")
    print("| threads | s a reference | GFLOP/s (profile FLOPs) | speed-up |")
    print("|---|---|---|---|")
    base = None
    for threads in (1, min(SCREEN_REF_MBS, os.cpu_count() or 1)):
        with ThreadPoolExecutor(max_workers=threads) as pool:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                reference_gradient(module, spec, 0, inputs, first=False, last=False, pool=pool if threads > 1 else None)
                best = min(best, time.perf_counter() - t0)
        base = base or best
        print(f"| {threads} | {best:.3f} | {flops / best / 1e9:.1f} | {base / best:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
