"""What receiving a large message costs the receiver: a weight pull assembled from its chunks
and decoded, parsed by protobuf (``parse_in_pieces``) against frames split from the received
bytes (``split_framed``, what a worker's pull and a server's streamed push use).

    PYTHONPATH=. python bench/bench_receive.py [--mb 390] [--repeat 3]

The message is a gpt-125m-like stage (a 50257 x 768 embedding and 768-wide matrices, fp32) in
1 MB chunks; each row times assembling, parsing and decoding every frame (checked finite, as
a pull is) in this one process, and counts its minor page faults (fresh pages touched).
"""

from __future__ import annotations

import argparse
import os
import resource
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=390.0, help="about this many MB of fp32 weights")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import torch

    from shoal.memory import tune_malloc
    from shoal.net import shoal_pb2 as pb
    from shoal.net.stream import Assembler, split
    from shoal.net.wire import decode_tensor
    from shoal.runtime.transport.frames import serialise_weights

    tune_malloc()  # as every shoal process does
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    params = {"wte": torch.randn(50257, 768, generator=g)}
    left, i = args.mb * 1e6 / 4 - params["wte"].numel(), 0
    while left > 0:
        params[f"h{i}"] = torch.randn(768, 3072 if i % 2 else 768, generator=g)
        left -= params[f"h{i}"].numel()
        i += 1
    field = pb.WeightsReply.DESCRIPTOR.fields_by_name["params"].number
    data = serialise_weights(pb.WeightsReply(version=1), params)
    chunks = list(split("WeightsReply", data, 1 << 20))

    def once(frames_field):
        t0, c0 = time.perf_counter(), time.process_time()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        asm = Assembler("WeightsReply", 1 << 31)
        for c in chunks:
            asm.add(c)
        rep = asm.finish(pb.WeightsReply, [], frames_field)
        for f in rep.params:
            decode_tensor(f, dtype="float32", finite=True)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        return time.perf_counter() - t0, time.process_time() - c0, faults

    print(f"a {len(data) / 1e6:.0f} MB weight pull ({len(params)} frames) in {len(chunks)} chunks, "
          f"assembled, parsed and decoded, {args.repeat} times each (the first of each is a warm-up)\n")
    print("| receive | CPU s | CPU ms per MB | page faults |")
    print("|---|---|---|---|")
    for name, ff in (("parse_in_pieces (protobuf)", None), ("split_framed (frames as views)", field)):
        runs = [once(ff) for _ in range(args.repeat + 1)][1:]
        cpu = min(r[1] for r in runs)
        print(f"| {name} | {cpu:.3f} | {cpu * 1e3 / (len(data) / 1e6):.2f} | {min(r[2] for r in runs):,} |",
              flush=True)


if __name__ == "__main__":
    main()
