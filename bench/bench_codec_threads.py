"""A ``lowrank`` stage frame's encode and decode on one thread against the codec threads.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bench_codec_threads.py --model gpt-1.3b --layers 2

What holds a local-mode stage server's merge beside the weighted sum: the round's last push is
decoded and the merged update the workers pull is encoded, a whole stage in one
:func:`shoal.runtime.sync.codecs.stage_frame` each (``shoal.plan.cost.merge_cpu_time``). Here a
stage of layers ``[1, 1 + L)`` of the model (random float32, the scale of a pseudo-gradient) is
encoded and decoded with ``--codec`` on one thread (torch on one thread, as the server runs it)
and with :func:`shoal.net.compress.set_codec_threads` at each count asked for. Printed: seconds,
nanoseconds an element (the cost model's ``CODEC_CPU_S``), the speed-up over one thread, and
whether the payload and the decoded tensor are the same bits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_merge_threads import stage_shapes  # noqa: E402

from shoal.net import compress  # noqa: E402
from shoal.runtime.sync.codecs import split_stage_frame, stage_frame  # noqa: E402


def _round(tensors: dict[str, torch.Tensor], codec: str) -> tuple[float, float, bytes, dict]:
    t0 = time.perf_counter()
    frame = stage_frame(tensors, codec)
    t1 = time.perf_counter()
    out = split_stage_frame(frame, tensors)
    return t1 - t0, time.perf_counter() - t1, frame.data, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks in the stage")
    ap.add_argument("--codec", default="lowrank")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 4], help="codec thread counts to time")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest is kept")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = stage_shapes(args.model, args.layers)
    params = sum(s.numel() for s in shapes.values())
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
    print(f"{args.model} layers [1, {1 + args.layers}): {params / 1e6:.1f} M parameters, codec {args.codec}, "
          f"{os.cpu_count()} CPUs")
    print("| threads | encode s | decode s | encode ns/elem | decode ns/elem | speed-up (both) | same bits |")
    print("|---|---|---|---|---|---|---|")
    rows, base = [], None
    for k in [1, *args.threads]:
        compress.set_codec_threads(k)
        best = min((_round(tensors, args.codec) for _ in range(args.repeat)), key=lambda x: x[0] + x[1])
        if base is None:
            base = best
        same = best[2] == base[2] and all(torch.equal(best[3][n], base[3][n]) for n in base[3])
        rows.append((k, best, same))
    compress.set_codec_threads(1)
    for k, (enc, dec, _, _), same in rows:
        print(f"| {k} | {enc:.3f} | {dec:.3f} | {enc / params * 1e9:.2f} | {dec / params * 1e9:.2f} | "
              f"{(base[0] + base[1]) / (enc + dec):.2f}x | {'yes' if same else 'NO'} |")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
