"""GPU benchmark: what one worker does per stage, in bf16 and fp32, and bf16 vs fp32 loss.

    .venv/bin/python bench/bench_gpu.py                      # on a CUDA machine (defaults)
    .venv/bin/python bench/bench_gpu.py --device cpu --smoke # end to end on a CPU: tiny shapes

Prints one table per part (markdown), every number measured in this run:

1. *Per stage*: each of ``--models`` is cut into ``--stages`` even stages; for each stage
   a worker's work on one micro-batch (forward, then backward through the kept graph, as
   a worker does with its graph cache; forward + loss + backward on the last stage) is
   timed in bf16 (autocast, fp32 weights) and fp32: tokens/s, achieved model FLOP/s
   (the analytic FLOPs of :mod:`shoal.model.profile`), model FLOP utilisation against
   the device's dense bf16/fp32 peak (``--peak-tflops``, or a table of known GPUs; on a
   CPU against a measured matmul peak in the same dtype), and the peak memory the stage
   needed on the device (CUDA only; the analytic worker memory is shown beside it).
2. *Loss*: ``shoal train --local`` of ``--loss-model`` for ``--loss-steps`` steps in fp32
   and in bf16 on ``--device``: loss at a few steps and the largest relative gap.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Dense peak TFLOP/s (bf16, fp32 without TF32) of GPUs we may be lent, from vendor sheets.
KNOWN_PEAKS = {
    "H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5), "L40S": (362.0, 91.6),
    "L4": (121.0, 30.3), "A10": (125.0, 31.2), "RTX 4090": (165.0, 82.6), "RTX 3090": (71.0, 35.6),
    "V100": (125.0, 15.7), "T4": (65.0, 8.1),
}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_peak(device, precision: str, given: float | None) -> tuple[float, str]:
    """Peak FLOP/s in ``precision`` and where the number comes from."""
    import torch

    if given:
        return given * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in KNOWN_PEAKS.items():
            if key in name:
                return (bf16 if precision == "bf16" else fp32) * 1e12, f"{key} sheet"
    # No sheet: a large matmul in the same dtype is the practical peak.
    n = 4096 if device.type == "cuda" else 256
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        a @ b
        reps += 1
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0), "measured matmul"


def time_stage(cfg, first: int, last: int, batch: int, seq: int, device, precision: str,
               iters: int) -> tuple[float, int | None]:
    """Seconds per micro-batch of a worker's forward + backward on layers [first, last),
    and the peak device memory (bytes, CUDA only)."""
    import torch

    from shoal.model.transformer import build_stage
    from shoal.train.precision import autocast, compute_dtype

    with torch.device(device):
        stage = build_stage(cfg, first, last, init=False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
    hidden = (torch.randn(batch, seq, cfg.d_model, generator=gen) * 0.02).to(device, compute_dtype(precision))
    last_stage = last == cfg.n_total_layers

    def one() -> None:
        x = ids if first == 0 else hidden.detach().requires_grad_(True)
        with autocast(device, precision):
            out = stage(x, ids) if last_stage else stage(x)
        (out if last_stage else out.float().square().mean()).backward()
        for p in stage.parameters():
            p.grad = None

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    one()  # warm-up (kernels, allocator)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        one()
    _sync(device)
    secs = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return secs, peak


def stage_table(args, device) -> list[str]:
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.runtime.common import even_split

    peaks = {p: device_peak(device, p, args.peak_tflops if p == "bf16" else args.peak_tflops_fp32)
             for p in ("bf16", "fp32")}
    rows = ["| model | stage | layers | precision | tokens/s | model TFLOP/s | MFU | peak mem (GiB) | "
            "analytic worker mem (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for name in args.models.split(","):
        cfg = get_preset(name)
        for s, (first, last) in enumerate(even_split(cfg.n_total_layers, args.stages)):
            for prec in ("bf16", "fp32"):
                prof = profile_model(cfg, args.seq_len, args.micro_batch_size, 2 if prec == "bf16" else 4)
                flops = prof.fwd_flops(first, last) + prof.bwd_flops(first, last)
                secs, mem = time_stage(cfg, first, last, args.micro_batch_size, args.seq_len, device, prec,
                                       args.iters)
                tokens = args.micro_batch_size * args.seq_len / secs
                peak, _ = peaks[prec]
                mem_s = f"{mem / 2**30:.2f}" if mem is not None else "n/a (CPU)"
                rows.append(f"| {name} | {s} | [{first}, {last}) | {prec} | {tokens:,.0f} | {flops / secs / 1e12:.3g} | "
                            f"{flops / secs / peak:.1%} | {mem_s} | {prof.worker_memory(first, last) / 2**30:.2f} |")
                print(rows[-1], flush=True)
    rows.append("")
    rows.append("MFU against: " + ", ".join(f"{p} {v / 1e12:.3g} TFLOP/s ({src})" for p, (v, src) in peaks.items()))
    return rows


def loss_table(args, device) -> list[str]:
    from shoal.train.local import TrainConfig, train_local

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for prec in ("fp32", "bf16"):
            t0 = time.perf_counter()
            res = train_local(TrainConfig(
                model=args.loss_model, steps=args.loss_steps, micro_batches=args.micro_batches,
                micro_batch_size=args.loss_micro_batch_size, seq_len=args.loss_seq_len, eval_every=0,
                eval_batches=1, out=str(Path(tmp) / prec), device=str(device), precision=prec), quiet=True)
            runs[prec] = ([r["loss"] for r in res.records], time.perf_counter() - t0)
    fp32, bf16 = runs["fp32"][0], runs["bf16"][0]
    gaps = [abs(b - f) / f for f, b in zip(fp32, bf16, strict=True)]
    n = len(fp32)
    marks = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})
    rows = [f"{args.loss_model}, {n} steps, M={args.micro_batches} B={args.loss_micro_batch_size} "
            f"T={args.loss_seq_len} on {device}", "",
            "| step | fp32 loss | bf16 loss | relative gap |", "|---|---|---|---|"]
    rows += [f"| {i} | {fp32[i]:.4f} | {bf16[i]:.4f} | {gaps[i]:.2%} |" for i in marks]
    rows += ["", f"largest relative gap over all steps: {max(gaps):.2%}; wall time fp32 {runs['fp32'][1]:.1f} s, "
                 f"bf16 {runs['bf16'][1]:.1f} s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--smoke", action="store_true", help="small shapes, so a CPU runs it end to end in minutes")
    p.add_argument("--models", default="gpt-125m,gpt-350m", help="presets to cut into stages (comma-separated)")
    p.add_argument("--stages", type=int, default=2, help="stages per model")
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per micro-batch (stage timing)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (stage timing)")
    p.add_argument("--iters", type=int, default=10, help="timed micro-batches per stage")
    p.add_argument("--peak-tflops", type=float, default=None, help="device dense bf16 peak (default: known GPUs)")
    p.add_argument("--peak-tflops-fp32", type=float, default=None, help="device dense fp32 peak")
    p.add_argument("--loss-model", default="gpt-125m", help="preset of the fp32 vs bf16 loss runs")
    p.add_argument("--loss-steps", type=int, default=50, help="steps of the loss runs")
    p.add_argument("--micro-batches", type=int, default=2, help="M of the loss runs")
    p.add_argument("--loss-micro-batch-size", type=int, default=8, help="B of the loss runs")
    p.add_argument("--loss-seq-len", type=int, default=256, help="T of the loss runs")
    args = p.parse_args(argv)
    if args.smoke:
        # CPU bf16 matmuls run at a small fraction of fp32 speed: tiny shapes only.
        args.models, args.micro_batch_size, args.seq_len, args.iters = "tiny", 1, 32, 1
        args.loss_model, args.loss_steps, args.loss_micro_batch_size, args.loss_seq_len = "tiny", 50, 2, 32

    import torch

    from shoal.train.local import set_torch_threads
    from shoal.train.precision import resolve_device

    set_torch_threads()
    device = resolve_device(args.device)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# bench_gpu on {device} ({what}), torch {torch.__version__}\n", flush=True)
    print(f"## Per stage: one micro-batch of B={args.micro_batch_size} x T={args.seq_len}, "
          f"{args.stages} stages per model\n", flush=True)
    rows = stage_table(args, device)
    print("\n".join(rows[-2:]), flush=True)
    print("\n## Loss, fp32 vs bf16\n", flush=True)
    print("\n".join(loss_table(args, device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
