"""A local-mode merge's weighted sum and norms on one thread against the server's merge pool.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bench_merge_threads.py --model gpt-350m --layers 4 --workers 8

``W`` decoded pseudo-gradients of one stage (layers ``[1, 1 + L)`` of the model, float32, random)
are merged as a stage server merges them: each contributor's squared norm, its cosine to the
screen's reference gradient and its term of the micro-batch-weighted sum, in one read of it
(:func:`shoal.runtime.safety.verify.screen_measures` with ``sum_weights``, as the server's screen
calls it, with a random reference; its median over a sample is priced apart and left out here;
``--no-reference``: no reference, as a server whose screen has none; the sum is checked once
against :func:`shoal.train.outer.weighted_sum`, bit for bit), once serially (torch on
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
from shoal.runtime.safety.verify import screen_measures  # noqa: E402
from shoal.train.outer import merge_weights, weighted_sum  # noqa: E402


def stage_shapes(model: str, layers: int) -> dict[str, torch.Size]:
    """Parameter shapes of a stage of ``model``'s layers ``[1, 1 + layers)`` (built on the meta device)."""
    cfg = get_preset(model)
    with torch.device("meta"):
        stage = build_stage(cfg, 1, 1 + layers, init=False)
    return {n: p.shape for n, p in stage.named_parameters()}


def _merge(pushes, shares, pool, ref=None):
    t0 = time.perf_counter()
    # as the server's screen reads each push: its norm, its cosine to the reference and its term
    # of the weighted sum (the merge takes that sum where the screen leaves every push in)
    norms, _, cos, out = screen_measures(pushes, dict.fromkeys(pushes, 1.0), len(pushes) + 1, ref=ref,
                                         sum_weights=shares, pool=pool)
    norms.update({f"cos {w}": c for w, c in cos.items()})
    return time.perf_counter() - t0, norms, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-350m")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks in the stage")
    ap.add_argument("--workers", type=int, default=8, help="pushes merged")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 4], help="pool sizes to time")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest is kept")
    ap.add_argument("--no-reference", action="store_true", help="leave out the cosines to a reference gradient")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = stage_shapes(args.model, args.layers)
    params = sum(s.numel() for s in shapes.values())
    g = torch.Generator().manual_seed(0)
    pushes = {f"w{i:02d}": {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
              for i in range(args.workers)}
    shares = merge_weights({w: 3 + i % 4 for i, w in enumerate(pushes)})
    ref = None if args.no_reference else {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    print(f"{args.model} layers [1, {1 + args.layers}): {params / 1e6:.1f} M parameters, {args.workers} pushes, "
          f"{os.cpu_count()} CPUs, {'no reference' if ref is None else 'cosines to a reference'}")
    print("| threads | merge s | ns a parameter of each push | speed-up | same bits |")
    print("|---|---|---|---|---|")
    base_s, base_n, base_o = min((_merge(pushes, shares, None, ref) for _ in range(args.repeat)), key=lambda x: x[0])
    # the sum from the screen's read is weighted_sum's, bit for bit
    fused_ok = all(torch.equal(base_o[k], v) for k, v in weighted_sum(pushes, shares).items())
    rows = [(1, base_s, fused_ok)]
    for k in args.threads:
        with ThreadPoolExecutor(max_workers=k) as pool:
            s, n, o = min((_merge(pushes, shares, pool, ref) for _ in range(args.repeat)), key=lambda x: x[0])
        same = n == base_n and all(torch.equal(o[x], base_o[x]) for x in base_o)
        rows.append((k, s, same))
    for k, s, same in rows:
        print(f"| {k} | {s:.3f} | {s / (params * args.workers) * 1e9:.2f} | {base_s / s:.2f}x | "
              f"{'yes' if same else 'NO'} |")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
