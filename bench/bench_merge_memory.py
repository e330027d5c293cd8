"""A stage server's memory and CPU for one local-mode merge: pushes held decoded against held as frames.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bench_merge_memory.py --model gpt-350m --layers 4 --workers 16

``W`` workers' pseudo-gradients of one stage (layers ``[1, 1 + L)`` of the model), each made of
random updates and encoded with the run's push codec into one real stage frame, reach a server;
each configuration runs in a fresh process, which decodes each push as the server does on
arrival (:func:`shoal.runtime.sync.codecs.split_stage_frame`), holds it in
:class:`shoal.runtime.sync.held.HeldPushes` within a merge memory budget, and then does what the
merge does: the screen's measures (:func:`shoal.runtime.safety.verify.round_measures`, quorum 3)
and the weighted sum (:func:`shoal.train.outer.weighted_sum`). Large frames (``int8``, raw) that
the budget does not hold go to disk as the server writes them (:class:`SpilledPush`), except in
the row "frames in memory" (what a server did before). Printed per budget: the process's peak
memory above what it held before the first push arrived (``ru_maxrss``; each push is read from
its file when it arrives), the seconds of the arrivals' decodes and of the merge, and the pushes
held as frames and on disk. The baseline is a budget that holds every push decoded (what every
server did before ``--merge-memory-gb``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _shapes(model: str, layers: int):
    import torch

    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage

    cfg = get_preset(model)
    with torch.device("meta"):
        stage = build_stage(cfg, 1, 1 + layers, init=False)
    return {n: p for n, p in stage.named_parameters()}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> int:
    import resource

    import torch

    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.safety.verify import round_measures
    from shoal.runtime.sync.codecs import split_stage_frame
    from shoal.runtime.sync.held import HeldPushes, SpilledPush
    from shoal.train.outer import merge_weights, weighted_sum

    torch.set_num_threads(1)
    shapes = _shapes(args.model, args.layers)
    files = sorted(Path(args.frames).glob("w*.bin"))
    start = _rss()  # (each push is read when it arrives: what the server holds of it is counted)
    held = HeldPushes(args.budget)
    t0 = time.perf_counter()
    nbytes = 4 * sum(p.numel() for p in shapes.values())

    def from_bytes(data):
        return split_stage_frame(pb.Tensor.FromString(data), shapes)

    for i, path in enumerate(files):
        frame = pb.Tensor.FromString(path.read_bytes())

        def decode(frame=frame):
            return split_stage_frame(frame, shapes)

        dense = decode()
        # as the server does: large frames the budget does not hold go to disk (--spill)
        spilled = (SpilledPush(frame.SerializeToString(), from_bytes, args.spill)
                   if args.spill and held.should_spill(nbytes, frame.ByteSize()) else None)
        held.put(f"w{i:03d}", dense, decode, frame.ByteSize(), spilled)
        del dense, spilled, frame
    t1 = time.perf_counter()
    counts = {w: 4 + (i % 3) for i, w in enumerate(held)}
    norms, cos = round_measures(held, dict.fromkeys(held, 1.0), 3, seed=1)
    merged = weighted_sum(held, merge_weights(counts))
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
    digest = float(sum(float(t.double().abs().sum()) for t in merged.values()))
    print(json.dumps({"peak": peak, "arrive_s": t1 - t0, "merge_s": t2 - t1, "framed": held.framed,
                      "spilled": held.spilled,
                      "cos_min": min(c for c in cos.values() if c is not None), "digest": digest}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-350m")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks in the stage")
    ap.add_argument("--workers", type=int, default=16, help="pushes the merge waits for")
    ap.add_argument("--codec", default="lowrank", help="the push codec")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--frames", default="", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--spill", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    import torch

    from shoal.runtime.sync.codecs import stage_frame

    torch.set_num_threads(1)
    shapes = _shapes(args.model, args.layers)
    n = sum(p.numel() for p in shapes.values())
    dense_bytes = 4 * n
    print(f"{args.model} layers [1, {1 + args.layers}): {n / 1e6:.1f} M parameters, {dense_bytes / 1e6:.0f} MB "
          f"decoded per push; {args.workers} pushes of {args.codec}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        wire = 0
        for i in range(args.workers):
            g = torch.Generator().manual_seed(i)
            d = {k: 1e-3 * torch.randn(p.shape, generator=g) for k, p in shapes.items()}
            frame = stage_frame(d, args.codec)
            wire = frame.ByteSize()
            Path(tmp, f"w{i:03d}.bin").write_bytes(frame.SerializeToString())
            del d
        print(f"frame {wire / 1e6:.2f} MB a push", flush=True)
        rows = []
        spill = str(Path(tmp, "spill"))
        for name, budget, where in (("every push decoded (before)", float("inf"), ""),
                                    ("half of them", dense_bytes * args.workers / 2, spill),
                                    ("none, frames in memory", 0.0, ""),
                                    ("none (--merge-memory-gb 0)", 0.0, spill)):
            cmd = [sys.executable, __file__, "--child", "--frames", tmp, "--budget", repr(budget),
                   "--model", args.model, "--layers", str(args.layers), "--spill", where]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            rows.append((name, res))
    base = rows[0][1]
    print("\n| merge memory | pushes held as frames | of them on disk | peak memory above the start | vs before | "
          "arrivals' decodes s | merge s | same merge |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['framed']} / {args.workers} | {r['spilled']} | {r['peak'] / 1e9:.2f} GB | "
              f"{r['peak'] / base['peak']:.2f}x | "
              f"{r['arrive_s']:.1f} | {r['merge_s']:.1f} | {'yes' if r['digest'] == base['digest'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
