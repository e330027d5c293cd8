"""A local-mode merge's weighted sum and norms on one thread against the server's merge pool.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bench_merge_threads.py --model gpt-350m --layers 4 --workers 8

``W`` decoded pseudo-gradients of one stage (layers ``[1, 1 + L)`` of the model, float32, random)
are merged as a stage server merges them: each contributor's squared norm
(:func:`shoal.runtime.safety.verify.sq_norm`, what the screen's measures take of every push) and
the micro-batch-weighted sum (:func:`shoal.train.outer.weighted_sum`), once serially (torch on
one thread, as before the pool) and once on a pool of each thread count asked for (the runtime
uses :func:`shoal.runtime.sync.local.merge_pool`, ``MERGE_THREADS`` threads at most). Printed:
nanoseconds a parameter of each push (the cost model's ``FrameworkCpu.server_merge_param_s``),
the speed-up over one thread, and whether the sum and the norms are the same bits.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from shoal.model.config import get_preset  # noqa: E402
from shoal.model.transformer import build_stage  # noqa: E402
from shoal.runtime.safety.verify import sq_norm  # noqa: E402
from shoal.train.outer import merge_weights, weighted_sum  # noqa: E402


def _shapes(model: str, layers: int) -> dict[str, torch.Size]:
    cfg = get_preset(model)
    with torch.device("meta"):
        stage = build_stage(cfg, 1, 1 + layers, init=False)
    return {n: p.shape for n, p in stage.named_parameters()}


def _merge(pushes, shares, pool):
    t0 = time.perf_counter()
    norms = {w: sq_norm(d, pool) for w, d in pushes.items()}
    out = weighted_sum(pushes, shares, pool)
    return time.perf_counter() - t0, norms, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-350m")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks in the stage")
    ap.add_argument("--workers", type=int, default=8, help="pushes merged")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 4], help="pool sizes to time")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest is kept")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = _shapes(args.model, args.layers)
    params = sum(s.numel() for s in shapes.values())
    g = torch.Generator().manual_seed(0)
    pushes = {f"w{i:02d}": {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
              for i in range(args.workers)}
    shares = merge_weights({w: 3 + i % 4 for i, w in enumerate(pushes)})
    print(f"{args.model} layers [1, {1 + args.layers}): {params / 1e6:.1f} M parameters, {args.workers} pushes, "
          f"{os.cpu_count()} CPUs")
    print("| threads | merge s | ns a parameter of each push | speed-up | same bits |")
    print("|---|---|---|---|---|")
    base_s, base_n, base_o = min((_merge(pushes, shares, None) for _ in range(args.repeat)), key=lambda x: x[0])
    rows = [(1, base_s, True)]
    for k in args.threads:
        with ThreadPoolExecutor(max_workers=k) as pool:
            s, n, o = min((_merge(pushes, shares, pool) for _ in range(args.repeat)), key=lambda x: x[0])
        same = n == base_n and all(torch.equal(o[x], base_o[x]) for x in base_o)
        rows.append((k, s, same))
    for k, s, same in rows:
        print(f"| {k} | {s:.3f} | {s / (params * args.workers) * 1e9:.2f} | {base_s / s:.2f}x | "
              f"{'yes' if same else 'NO'} |")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
