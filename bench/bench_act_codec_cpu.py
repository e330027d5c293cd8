"""CPU per element of each activation codec, as the runtime encodes and decodes a boundary tensor.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bench_act_codec_cpu.py [--models gpt-1.3b,gpt-350m]
        [--repeat 5] [--codecs none,int8,quad-pc,tern-dither]

A worker encodes its output activation (forward) or its input's gradient (backward) with the
plan's ``act`` / ``grad`` codec (:func:`shoal.net.wire.encode_frame`, the payload a view where
the codec is raw) after its compute, and decodes its input (``decode_tensor``, checked finite,
no copy) before it; a stage server decodes every lossy result and relay it takes to check it
(``shoal.runtime.sync.codecs.received_activation``). Here a tensor of one micro-batch at the
model's stage boundary (B = 1, T = 1,024 rows of ``d_model`` bf16 channels: a residual stream
with per-channel offsets, random) is encoded and decoded ``--repeat`` times per codec on one
torch thread, with the allocator tuned as every shoal process has it (``shoal.memory.tune_malloc``). Printed: nanoseconds of CPU (process time) an element each way, the wire bytes
and their ratio to bf16: the basis of ``shoal.plan.compression.ACT_CODEC_CPU_S``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from shoal.memory import tune_malloc  # noqa: E402
from shoal.model.config import PRESETS  # noqa: E402
from shoal.net.compress import sr_key  # noqa: E402
from shoal.net.wire import decode_tensor, encode_frame  # noqa: E402

CODECS = ("none", "fp16", "int8", "tern", "tern-sr", "quad", "oct", "quad-pc", "tern-dither")


def boundary_tensor(rows: int, channels: int, seed: int = 0) -> torch.Tensor:
    """A bf16 ``(1, rows, channels)`` tensor shaped like a residual stream: unit noise on
    per-channel offsets (what ``quad-pc``'s channel means and directions take out)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=g) + 2 * torch.randn(channels, generator=g)
    return x.to(torch.bfloat16).reshape(1, rows, channels)


def measure(x: torch.Tensor, codec: str, repeat: int) -> tuple[float, float, int]:
    """(encode, decode) CPU seconds per element and the payload bytes of ``codec`` on ``x``."""
    wire = "raw" if codec == "none" else codec
    key = sr_key(0, 1, 2, 3, 0)
    frame = encode_frame("out", x, wire, None, key, None, True)  # (warm-up)
    decode_tensor(frame, shape=list(x.shape), dtype="bfloat16", finite=True, copy=False)
    enc = dec = 0.0
    for _ in range(repeat):
        t0 = time.process_time()
        frame = encode_frame("out", x, wire, None, key, None, True)
        t1 = time.process_time()
        decode_tensor(frame, shape=list(x.shape), dtype="bfloat16", finite=True, copy=False)
        t2 = time.process_time()
        enc, dec = enc + t1 - t0, dec + t2 - t1
    n = x.numel() * repeat
    return enc / n, dec / n, len(frame.data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt-1.3b,gpt-350m", help="model presets (their d_model is the width)")
    ap.add_argument("--rows", type=int, default=1024, help="rows of the tensor (B x T of a micro-batch)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--codecs", default=",".join(CODECS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tune_malloc()  # as every shoal process does at start
    print("| model (rows x channels) | codec | encode ns/element | decode ns/element | payload bytes | bf16 / payload |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        width = PRESETS[name].d_model
        x = boundary_tensor(args.rows, width)
        for codec in args.codecs.split(","):
            enc, dec, nbytes = measure(x, codec, args.repeat)
            print(f"| {name} ({args.rows} x {width}) | {codec} | {enc * 1e9:.2f} | {dec * 1e9:.2f} | {nbytes:,} | "
                  f"{x.numel() * 2 / nbytes:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
