"""What a large message costs its two ends: a weight pull serialised by its sender and received
(assembled from chunks, parsed, decoded) by its receiver, the old way and the way the runtime
does it now.

    PYTHONPATH=. python bench/bench_large_messages.py [--mb 390] [--repeat 3]

The message is a gpt-125m-like stage (a 50257 x 768 embedding and 768-wide matrices, fp32).
Sending: frames whose payloads are copies of the tensors (``tobytes``) against views of them
(``encode_frame(view=True)``), each serialised by ``serialize_framed``. Receiving, in 1 MB
chunks: protobuf parses the frames (``parse_in_pieces``) against frames split from the
received bytes (``split_framed``), then every frame is decoded and checked finite, as a pull
is. Each row is this one process's CPU time (the best of ``--repeat`` after a warm-up) and its
minor page faults (fresh pages touched).
"""

from __future__ import annotations

import argparse
import os
import resource
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _timed(fn, repeat: int) -> tuple[float, int]:
    """(least CPU seconds, least page faults) of ``fn()`` over ``repeat`` runs after a warm-up."""
    runs = []
    for _ in range(repeat + 1):
        c0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        runs.append((time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
    return min(r[0] for r in runs[1:]), min(r[1] for r in runs[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=390.0, help="about this many MB of fp32 weights")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import torch

    from shoal.memory import tune_malloc
    from shoal.net import shoal_pb2 as pb
    from shoal.net.stream import Assembler, split
    from shoal.net.wire import decode_tensor, encode_frame, serialize_framed

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
    head = pb.WeightsReply(version=1)

    def serialise(view: bool) -> bytes:
        return serialize_framed(head, field, [encode_frame(n, p, view=view) for n, p in params.items()])

    data = serialise(True)
    chunks = list(split("WeightsReply", data, 1 << 20))

    def receive(frames_field) -> None:
        asm = Assembler("WeightsReply", 1 << 31)
        for c in chunks:
            asm.add(c)
        for f in asm.finish(pb.WeightsReply, [], frames_field).params:
            decode_tensor(f, dtype="float32", finite=True)

    mb = len(data) / 1e6
    print(f"a {mb:.0f} MB weight pull ({len(params)} frames; {len(chunks)} chunks received), "
          f"best of {args.repeat} after a warm-up\n")
    print("| end | how | CPU s | CPU ms per MB | page faults |")
    print("|---|---|---|---|---|")
    for end, how, fn in (("send", "payloads copied (tobytes), serialize_framed", lambda: serialise(False)),
                         ("send", "payloads as views, serialize_framed", lambda: serialise(True)),
                         ("receive", "parse_in_pieces (protobuf), decode", lambda: receive(None)),
                         ("receive", "split_framed (frames as views), decode", lambda: receive(field))):
        cpu, faults = _timed(fn, args.repeat)
        print(f"| {end} | {how} | {cpu:.3f} | {cpu * 1e3 / mb:.2f} | {faults:,} |", flush=True)


if __name__ == "__main__":
    main()
