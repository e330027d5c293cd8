"""Compression measurement helper: wire bytes and final loss of codecs vs an uncompressed run.

Shared by ``tests/test_compress_bench.py`` and ``bench/bench_compress.py`` (which prints the
table). :func:`run` trains the tiny model as a
two-stage pipeline in one process, exactly as the runtime moves tensors between roles,
and passes every tensor that would cross the network through its codec:

* ``activations`` -- stage 0's output, encoded and decoded before stage 1 sees it;
* ``act_grads`` -- the gradient w.r.t. that activation, on its way back;
* ``grad_push`` -- each stage's summed parameter gradient, worker -> server, with
  :class:`~shoal.net.compress.ErrorFeedback` per parameter;
* ``weight_pull`` -- server -> worker: the worker computes on its own replica of the
  weights, which the server updates each step by sending the *delta* between master
  and replica. Because the delta is taken against the replica (not against the previous
  master), what one step's rounding missed is sent the next step: error feedback
  without extra state.

Each configuration starts from the same weights and data order (seed); the table shows
wire bytes vs fp32 and the final validation loss vs the ``raw`` run of the same length.
The codec's numerical effect is the same as in the distributed runtime; only the number
of workers (one per stage here) differs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from shoal.data import DataConfig, get_micro_batch, load_data
from shoal.model.config import get_preset
from shoal.model.transformer import build_stage
from shoal.net.compress import CompressionConfig, ErrorFeedback, WireCounter, decode, encode, sr_key
from shoal.net.shoal_pb2 import FWD, FWDBWD
from shoal.train.optim import (
    OptimConfig,
    apply_update,
    clip_coefficient,
    grad_sq_norm,
    lr_at,
    make_optimizer,
)

CONFIGS: dict[str, CompressionConfig] = {  # name -> codecs of the four traffic kinds
    "raw": CompressionConfig(),
    "fp16": CompressionConfig("fp16", "fp16", "fp16", "fp16"),
    "int8-act": CompressionConfig("int8", "int8", "raw", "raw"),
    "int8-all": CompressionConfig("int8", "int8", "int8", "int8"),
    "tern-act": CompressionConfig("tern", "tern", "raw", "raw"),  # activations and their gradients in tern
    "tern-fwd": CompressionConfig("tern", "raw", "raw", "raw"),  # activations only (which direction costs)
    "tern-bwd": CompressionConfig("raw", "tern", "raw", "raw"),  # activation gradients only
    "tern-sr": CompressionConfig("tern", "tern-sr", "raw", "raw"),  # tern forward, stochastic tern back
    "tern-sr-bwd": CompressionConfig("raw", "tern-sr", "raw", "raw"),  # stochastic tern gradients only
    "quad-sr": CompressionConfig("quad", "tern-sr", "raw", "raw"),  # 2-bit forward, stochastic tern back: 8.31x
    "quad-fwd": CompressionConfig("quad", "raw", "raw", "raw"),  # 2-bit activations only
    "tern-sr-both": CompressionConfig("tern-sr", "tern-sr", "raw", "raw"),  # stochastic (unbiased) both ways
    "oct-td": CompressionConfig("oct", "tern-dither", "raw", "raw"),  # 3-bit forward, tern-dither back: 8.13x
    "td-bwd": CompressionConfig("raw", "tern-dither", "raw", "raw"),  # tern-dither gradients only
    "oct-fwd": CompressionConfig("oct", "raw", "raw", "raw"),  # 3-bit activations only
    "oct-sr": CompressionConfig("oct", "tern-sr", "raw", "raw"),  # 3-bit forward, tern-sr back (4.85 bits)
    "qpc-td": CompressionConfig("quad-pc", "tern-dither", "raw", "raw"),  # means, 4 principal directions and quad forward, tern-dither back
    "qpc-fwd": CompressionConfig("quad-pc", "raw", "raw", "raw"),  # quad-pc activations only
}


@dataclass
class BenchConfig:
    """One measurement run."""

    model: str = "tiny"  # model preset
    steps: int = 150  # optimizer steps
    micro_batches: int = 4  # M per step
    micro_batch_size: int = 8  # B
    seq_len: int = 128  # T
    split: int = 3  # first layer of stage 1 (stage 0 = [0, split))
    lr: float = 3e-3  # peak learning rate
    warmup: int = 10  # warm-up steps
    eval_batches: int = 8  # validation micro-batches at the end
    seed: int = 0  # weights and data order


def _send(t: torch.Tensor, codec: str, block: int, kind: str, counter: WireCounter,
          ef: ErrorFeedback | None = None, name: str = "", key: int = 0) -> torch.Tensor:
    """``t`` as the receiver sees it after the wire; counts the bytes (``key``: a stochastic
    codec's rounding key, as the runtime's worker makes it)."""
    payload, meta = ef.encode(name, t) if ef is not None else encode(t, codec, block, key)
    counter.add(kind, t.numel(), len(payload))
    return decode(payload, meta, t.shape, torch.float32)


def run(cfg: BenchConfig, comp: CompressionConfig, data=None) -> dict:
    """Train with ``comp``; returns final val loss, last train losses and byte counts."""
    mcfg = get_preset(cfg.model)
    if data is None:
        data = load_data(DataConfig(), mcfg.vocab_size)
    n = mcfg.n_total_layers
    optim = OptimConfig(lr=cfg.lr, min_lr=cfg.lr / 10, warmup_steps=cfg.warmup)
    bounds = [(0, cfg.split), (cfg.split, n)]
    masters = [build_stage(mcfg, a, b, cfg.seed) for a, b in bounds]
    replicas = [build_stage(mcfg, a, b, cfg.seed) for a, b in bounds]  # the workers' copies
    opts = [make_optimizer(m.named_parameters(), optim) for m in masters]
    counter = WireCounter()
    blk = comp.block
    push_ef = [ErrorFeedback(comp.grad_push, blk) if comp.error_feedback else None for _ in bounds]
    losses: list[float] = []
    t0 = time.monotonic()
    for step in range(cfg.steps):
        for r in replicas:
            r.zero_grad(set_to_none=True)
        step_losses = []
        for mb in range(cfg.micro_batches):
            x, y = get_micro_batch(data, "train", cfg.seed, step, mb, cfg.micro_batch_size, cfg.seq_len)
            h = replicas[0](x)
            h_in = _send(h.detach(), comp.activations, blk, "activations", counter,
                         key=sr_key(cfg.seed, 0, step, mb, FWD)).requires_grad_(True)
            loss = replicas[1](h_in, y)
            (loss / cfg.micro_batches).backward()
            g = _send(h_in.grad, comp.act_grads, blk, "act_grads", counter, key=sr_key(cfg.seed, 1, step, mb, FWDBWD))
            h.backward(g)
            step_losses.append(float(loss.detach()))
        losses.append(sum(step_losses) / len(step_losses))
        # gradient push: replica grads -> master grads, through the codec
        for s, (rep, mas) in enumerate(zip(replicas, masters, strict=True)):
            mp = dict(mas.named_parameters())
            for name, p in rep.named_parameters():
                mp[name].grad = _send(p.grad, comp.grad_push, blk, "grad_push", counter,
                                      push_ef[s] if comp.grad_push != "raw" else None, name)
        sq = sum(grad_sq_norm(m.parameters()) for m in masters)
        coef = clip_coefficient(sq, optim.grad_clip)
        lr = lr_at(step, cfg.steps, optim)
        for o in opts:
            apply_update(o, lr, coef)
        # weight pull: send master - replica, the replica adds what arrives
        with torch.no_grad():
            for rep, mas in zip(replicas, masters, strict=True):
                mp = dict(mas.named_parameters())
                for name, p in rep.named_parameters():
                    p.add_(_send(mp[name].detach() - p, comp.weight_pull, blk, "weight_pull", counter))
    # validation on the master weights (what the run's checkpoint holds)
    with torch.no_grad():
        vals = []
        for i in range(cfg.eval_batches):
            x, y = get_micro_batch(data, "val", cfg.seed, 0, i, cfg.micro_batch_size, cfg.seq_len)
            vals.append(float(masters[1](masters[0](x), y)))
    return {"val_loss": sum(vals) / len(vals), "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]) if losses else math.nan,
            "bytes": counter.as_dict(), "seconds": time.monotonic() - t0}
