"""CPU of a worker's weight pull after its bytes are in: ``apply_pull`` (frames checked and
decoded) and the copy into the stage's parameters, six pulls in a row, for gpt-125m's first
stage (layers [0, 7): 81 M parameters) framed as a stage server frames it.

    cd TREE && OMP_NUM_THREADS=1 python bench/bench_pull_decode.py TREE

``TREE``: the checkout whose ``shoal`` is measured (put first on ``sys.path``). Prints each
pull's process CPU and wall seconds; the first pull is the process's first touch of that much
fresh memory where the decode copies (page faults), the others reuse freed memory.
"""

import sys
import time

import numpy as np
import torch

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
from shoal.memory import tune_malloc  # noqa: E402

tune_malloc()  # (as every shoal process does at start)
torch.set_num_threads(1)
from shoal.model.config import get_preset  # noqa: E402
from shoal.model.transformer import build_stage  # noqa: E402
from shoal.net import shoal_pb2 as pb  # noqa: E402
from shoal.net.wire import Frame, serialize_framed, split_framed  # noqa: E402
from shoal.runtime.sync.codecs import apply_pull  # noqa: E402

mc = get_preset("gpt-125m")
stage = build_stage(mc, 0, 7, 0)
params = dict(stage.named_parameters())
fr = [Frame(name=n, dtype="float32", shape=list(p.shape), data=memoryview(p.detach().numpy()).cast("B"),
            codec="raw", meta=b"") for n, p in params.items()]
head = pb.WeightsReply(version=1, epoch=0, first=0, last=7)
buf = serialize_framed(head, 5, fr)
arr = np.frombuffer(buf, dtype=np.uint8).copy()  # the received message (a worker's own copy)
ts = []
for _ in range(6):
    rep = split_framed(memoryview(arr), pb.WeightsReply, 5)
    t0, w0 = time.process_time(), time.perf_counter()
    new = apply_pull(rep, params, None, ("", -1))
    with torch.no_grad():
        for n, t in new.items():
            params[n].copy_(t)
    ts.append((time.process_time() - t0, time.perf_counter() - w0))
    del new, rep
print(sys.argv[1] if len(sys.argv) > 1 else ".", f"params {sum(p.numel() for p in params.values()) / 1e6:.1f} M",
      "cpu s", " ".join(f"{c:.3f}" for c, _ in ts), "| wall", " ".join(f"{w:.3f}" for _, w in ts))
