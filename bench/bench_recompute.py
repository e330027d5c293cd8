"""What a stage server's check of one push costs: :func:`shoal.runtime.safety.verify.recompute_sum`
of a push's micro-batches on 1 .. N threads (one a micro-batch).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_recompute.py [--model tiny] [--layers 0:4]
        [--mbs 4] [--micro-batch-size 4] [--seq-len 64] [--threads 1,2] [--repeat 5]

A server recomputes a worker's first pushes, flagged ones, drawn ones no other worker can check
and the run's last step (``StageServer._guard_push``), on the commit's critical path: the
step's commit waits for it. Each row is the best of ``--repeat`` runs of the same push; the
sums are checked to be the same bits on every thread count.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from shoal.model.config import get_preset  # noqa: E402
from shoal.model.transformer import build_stage  # noqa: E402
from shoal.net import shoal_pb2 as pb  # noqa: E402
from shoal.runtime.safety.verify import recompute_sum  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", default="0:4", help="the stage's layers FIRST:LAST (half-open)")
    ap.add_argument("--mbs", type=int, default=4, help="micro-batches in the push")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = get_preset(args.model)
    lo, hi = (int(x) for x in args.layers.split(":"))
    first, last = lo == 0, hi == cfg.n_layers + 2
    module = build_stage(cfg, lo, hi)
    spec = pb.RunSpec(model=args.model, micro_batches=args.mbs, micro_batch_size=args.micro_batch_size,
                      seq_len=args.seq_len, seed=0, data="synthetic")
    gen = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq_len, cfg.d_model)
    inputs = [(mb, None if first else torch.randn(shape, generator=gen),
               None if last else torch.randn(shape, generator=gen)) for mb in range(args.mbs)]
    print(f"push check: {args.model} layers [{lo}, {hi}), {args.mbs} micro-batches of "
          f"{args.micro_batch_size} x {args.seq_len} tokens, best of {args.repeat}\n")
    print("| threads | ms a push | speed-up |")
    print("|---|---|---|")
    base, ref = None, None
    for n in (int(x) for x in args.threads.split(",")):
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            got = recompute_sum(module, spec, 0, inputs, first=first, last=last, threads=n)
            best = min(best, time.perf_counter() - t0)
        if ref is None:
            ref = got
        assert all(torch.equal(got[k], ref[k]) for k in ref), f"{n} threads gave other bits"
        base = base or best
        print(f"| {n} | {best * 1e3:.1f} | {base / best:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
