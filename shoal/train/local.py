"""The reference trainer: the whole model in one process, with the exact step semantics
that the distributed runtime reproduces.

One optimizer step ``t`` (0-based) of a run with ``M`` micro-batches of ``B`` x ``T``:

1. for ``mb`` in ``0..M-1``: ``x, y = get_micro_batch(data, "train", seed, t, mb, B, T)``;
   ``loss_mb = model(x, y)``; ``(loss_mb / M).backward()`` (gradients add up);
2. logged loss = mean of the ``M`` values ``loss_mb``;
3. ``sq = grad_sq_norm(params)``, ``grad_norm = sqrt(sq)``, ``coef = clip_coefficient(sq, clip)``;
4. ``apply_update(optimizer, lr_at(t, steps, optim), coef)``.

After step ``t`` commits, if ``(t + 1) % eval_every == 0`` or ``t`` is the last step, the
validation loss of the updated weights is the mean loss over the fixed micro-batches
``get_micro_batch(data, "val", seed, 0, i, B, T)`` for ``i < eval_batches``
(see :func:`val_micro_batches`), recorded as ``val_loss`` in step ``t``'s record.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from shoal.data import TokenData, check_batch_shape, get_micro_batch, load_data
from shoal.errors import ShoalError
from shoal.model.transformer import Stage, build_stage
from shoal.train.checkpoint import (
    load_checkpoint,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    save_checkpoint,
)
from shoal.train.config import TrainConfig
from shoal.train.metrics import JsonlWriter, step_record
from shoal.train.optim import (
    OptimConfig,
    apply_update,
    clip_coefficient,
    grad_sq_norm,
    lr_at,
    make_optimizer,
)
from shoal.train.precision import (
    LossScaleConfig,
    autocast,
    backward_loss,
    check_device_precision,
    initial_loss_scale,
    next_loss_scale,
    overflowed,
    resolve_device,
    to_device,
    unscale_grads,
)

CHECKPOINT_DIR = "checkpoint"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


def set_torch_threads(default: int | None = None) -> int:
    """Set torch's intra-op threads from ``$SHOAL_TORCH_THREADS`` (default: up to 4 cores)."""
    if default is None:
        default = max(1, min(4, os.cpu_count() or 1))
    raw = os.environ.get("SHOAL_TORCH_THREADS", str(default))
    try:
        n = int(raw)
    except ValueError:
        raise ShoalError(f"SHOAL_TORCH_THREADS must be a positive integer, got {raw!r}") from None
    if n <= 0:
        raise ShoalError(f"SHOAL_TORCH_THREADS must be a positive integer, got {raw!r}")
    torch.set_num_threads(n)
    return n


@dataclass
class TrainResult:
    """Outcome of :func:`train_local`."""

    model: Stage  # the trained model (all layers)
    records: list[dict[str, Any]]  # metrics.jsonl records of every step so far
    steps_done: int  # optimizer steps completed (including those before a resume)
    out: Path  # run folder
    interrupted: bool = False  # stopped early by SIGINT/SIGTERM (a checkpoint was written)


class _StopRequest:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step.

    A step interrupted half-way (gradients partly summed, AdamW half applied) could not be
    checkpointed exactly, so the loop finishes the step, checkpoints and returns. A second
    Ctrl-C interrupts at once, as usual.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def val_micro_batches(
    data: TokenData, seed: int, n_batches: int, micro_batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation micro-batches of a run: step 0, micro-batches ``0..n-1`` of "val"."""
    return [get_micro_batch(data, "val", seed, 0, i, micro_batch_size, seq_len) for i in range(n_batches)]


@dataclass
class Precision:
    """Where and in which precision a local run computes, and its fp16 loss-scale state."""

    device: torch.device  # where the model and the micro-batches live
    precision: str = "fp32"  # fp32 | bf16 | fp16 (see shoal.train.precision)
    scale: float = 1.0  # loss scale of the next step (1: no scaling)
    good_steps: int = 0  # consecutive steps without overflow (fp16 scale growth)
    scaling: LossScaleConfig = LossScaleConfig()  # fp16 dynamic loss scaling rule


CPU_FP32 = Precision(torch.device("cpu"))


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    loss: float  # mean micro-batch loss
    grad_norm: float | None  # global gradient norm before clipping (None: overflowed)
    lr: float  # learning rate of the step
    skipped: bool = False  # fp16: the gradients overflowed, no update was applied
    loss_scale: float = 1.0  # loss scale the step used


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             prec: Precision = CPU_FP32) -> float:
    """Mean loss of a full model (a stage from embedding to head) over ``batches``."""
    was_training = model.training
    model.eval()
    try:
        losses = []
        for x, y in batches:
            with autocast(prec.device, prec.precision):
                losses.append(float(model(to_device(x, prec.device), to_device(y, prec.device))))
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: TokenData,
    cfg: TrainConfig,
    optim: OptimConfig,
    step: int,
    prec: Precision = CPU_FP32,
) -> StepOutcome:
    """Run optimizer step ``step`` (updates ``prec``'s loss-scale state in fp16 runs)."""
    m = cfg.micro_batches
    scale = prec.scale
    losses = []
    for mb in range(m):
        x, y = get_micro_batch(data, "train", cfg.seed, step, mb, cfg.micro_batch_size, cfg.seq_len)
        with autocast(prec.device, prec.precision):
            loss = model(to_device(x, prec.device), to_device(y, prec.device))
        backward_loss(loss, m, scale)
        losses.append(float(loss.detach()))
    unscale_grads(model.parameters(), scale)
    sq = grad_sq_norm(model.parameters())
    lr = lr_at(step, cfg.steps, optim)
    skipped = prec.precision == "fp16" and overflowed(sq)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        apply_update(optimizer, lr, clip_coefficient(sq, optim.grad_clip))
    if prec.precision == "fp16":
        prec.scale, prec.good_steps = next_loss_scale(scale, prec.good_steps, skipped, prec.scaling)
    return StepOutcome(sum(losses) / m, None if skipped else math.sqrt(sq), lr, skipped, scale)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _write_checkpoint(
    out: Path, model: Stage, optimizer, cfg: TrainConfig, step: int, records: list, text_hash: str,
    prec: Precision = CPU_FP32,
) -> None:
    named = list(model.named_parameters())
    state = {"step": step, "config": cfg.to_dict(), "model_config": model.cfg.to_dict(),
             "corpus_hash": text_hash, "metrics": records,
             "loss_scale": prec.scale, "good_steps": prec.good_steps}
    save_checkpoint(out / CHECKPOINT_DIR, model.state_dict(), optimizer_state_by_name(optimizer, named), state)


class _Progress:
    """A rich progress bar on a terminal, a plain line every few steps otherwise."""

    def __init__(self, total: int, start: int, log_every: int, quiet: bool):
        self.log_every, self.quiet, self.total = log_every, quiet, total
        self.bar = None
        if not quiet and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, rec: dict[str, Any]) -> None:
        info = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:.0f} tok/s"
        if "val_loss" in rec:
            info += f"  val {rec['val_loss']:.4f}"
        step = rec["step"] + 1
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif not self.quiet and (step % self.log_every == 0 or step == self.total or "val_loss" in rec):
            print(f"step {step}/{self.total}  {info}  lr {rec['lr']:.2e}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def train_local(cfg: TrainConfig, resume: bool = False, quiet: bool = False) -> TrainResult:
    """Train (or with ``resume`` continue) a run in ``cfg.out``; see the module docstring."""
    cfg.validate()
    set_torch_threads()
    out = Path(cfg.out)
    ckpt_path = out / CHECKPOINT_DIR
    model_cfg = cfg.model_config()
    if not resume and (ckpt_path.exists() or (out / METRICS_FILE).exists()):
        raise ShoalError(f"{str(out)!r} already holds a run; continue it with --resume {out} or pick another --out")
    data = load_data(cfg.data_config(), model_cfg.vocab_size)
    check_batch_shape(data, "train", cfg.micro_batch_size, cfg.seq_len)
    check_batch_shape(data, "val", cfg.micro_batch_size, cfg.seq_len)
    optim = cfg.optim_config()
    device = resolve_device(cfg.device)
    check_device_precision(device, cfg.precision)
    scaling = cfg.loss_scale_config()
    prec = Precision(device, cfg.precision, initial_loss_scale(cfg.precision, scaling), 0, scaling)

    # Built (and initialised) on the CPU, so the weights are the same on every device.
    model = build_stage(model_cfg, 0, model_cfg.n_total_layers, cfg.seed)
    if cfg.init_from and not resume:
        from shoal.hf.convert import load_hf_dir

        _, state = load_hf_dir(cfg.init_from)
        model.load_state_dict(state, strict=True)
    model = model.to(device)
    model.train()
    optimizer = make_optimizer(model.named_parameters(), optim)
    start, records = 0, []
    if resume:
        ck = load_checkpoint(ckpt_path)
        try:
            model.load_state_dict(ck.model_state, strict=True)
        except RuntimeError as exc:
            raise ShoalError(f"checkpoint in {str(out)!r} does not fit model {cfg.model}: {str(exc).splitlines()[0]}") from None
        load_optimizer_state_by_name(optimizer, model.named_parameters(), ck.optimizer_state)
        start, records = int(ck.state["step"]), list(ck.state.get("metrics", []))
        prec.scale = float(ck.state.get("loss_scale", prec.scale))
        prec.good_steps = int(ck.state.get("good_steps", 0))
        saved_hash = ck.state.get("corpus_hash")
        if saved_hash and saved_hash != data.corpus_hash:
            raise ShoalError(f"the training text changed since the checkpoint in {str(out)!r}; resume with the same --data files")
        # Steps logged after the checkpoint (a crash) are redone, so drop their records.
        records = [r for r in records if r["step"] < start]
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(out / TOKENIZER_FILE, data.tokenizer.to_str())
    _atomic_write_text(out / CONFIG_FILE, json.dumps(
        {"config": cfg.to_dict(), "model_config": model_cfg.to_dict()}, indent=1, sort_keys=True))
    _atomic_write_text(out / METRICS_FILE, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))

    end = cfg.steps if cfg.stop_after is None else max(start, cfg.stop_after)
    val_batches = val_micro_batches(data, cfg.seed, cfg.eval_batches, cfg.micro_batch_size, cfg.seq_len)
    tokens_per_step = cfg.micro_batches * cfg.micro_batch_size * cfg.seq_len
    t0 = time.time() - (records[-1]["time_s"] if records else 0.0)
    progress = _Progress(cfg.steps, start, cfg.log_every, quiet)
    done = start
    try:
        with JsonlWriter(out / METRICS_FILE, t0=t0) as writer, _StopRequest() as stop:
            for step in range(start, end):
                ts = time.perf_counter()
                res = train_step(model, optimizer, data, cfg, optim, step, prec)
                step_time = time.perf_counter() - ts
                val = None
                last = step == cfg.steps - 1
                if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                    val = evaluate(model, val_batches, prec)
                rec = step_record(step, res.loss, res.lr, res.grad_norm, tokens_per_step, step_time,
                                  time.time() - t0, val)
                if cfg.precision == "fp16":
                    rec["loss_scale"], rec["skipped"] = res.loss_scale, res.skipped
                records.append(rec)
                writer.write(rec)
                progress.update(rec)
                done = step + 1
                every = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
                if done == end or every or stop.requested:
                    _write_checkpoint(out, model, optimizer, cfg, done, records, data.corpus_hash, prec)
                if stop.requested:
                    break
            interrupted = stop.requested and done < end
    finally:
        progress.close()
    return TrainResult(model=model, records=records, steps_done=done, out=out, interrupted=interrupted)


def resume_config(out: str | Path, **overrides: Any) -> TrainConfig:
    """The config of the run checkpointed in ``out``, with some fields replaced.

    Only fields that do not change the math of the steps already taken can be replaced
    (``steps`` changes the schedule from here on, which is allowed to extend a run).
    """
    ck_state = load_checkpoint(Path(out) / CHECKPOINT_DIR).state
    cfg = TrainConfig.from_dict(ck_state["config"])
    allowed = {"steps", "stop_after", "eval_every", "checkpoint_every", "log_every", "cache_dir", "device"}
    bad = sorted(k for k in overrides if k not in allowed)
    if bad:
        raise ShoalError(f"--{bad[0].replace('_', '-')} cannot be changed when resuming; it is fixed by the checkpoint")
    cfg = replace(cfg, **{"out": str(out), "stop_after": None, **overrides})
    if cfg.steps < int(ck_state["step"]):
        raise ShoalError(f"--steps {cfg.steps} is fewer than the {ck_state['step']} steps already done")
    return cfg
