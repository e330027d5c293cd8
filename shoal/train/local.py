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
    scaled_share,
    to_device,
    unscale_grads,
)

CHECKPOINT_DIR = "checkpoint"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


def set_torch_threads(default: int = 1) -> int:
    """Set torch's intra-op threads: ``$SHOAL_TORCH_THREADS``, else ``default`` (1).

    One intra-op thread is the arithmetic of an exact run: several CPU kernels split their
    work (and so their float sums) by thread count, so a step computed with 3 threads
    differs in the last bits from one computed with 1. Every swarm member computes with one
    thread; the local trainer does too by default and gets its parallelism from computing
    micro-batches side by side (:func:`micro_batch_threads`). Returns the thread count.
    """
    n = env_threads()
    n = default if n is None else n
    torch.set_num_threads(n)
    return n


def env_threads() -> int | None:
    """``$SHOAL_TORCH_THREADS`` as a positive int (None: unset); anything else is a ShoalError."""
    raw = os.environ.get("SHOAL_TORCH_THREADS")
    if raw is None or raw == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ShoalError(f"SHOAL_TORCH_THREADS must be a positive integer, got {raw!r}") from None
    if n <= 0:
        raise ShoalError(f"SHOAL_TORCH_THREADS must be a positive integer, got {raw!r}")
    return n


def micro_batch_threads(device: torch.device, micro_batches: int, intra_op: int,
                        cores: int | None = None) -> int:
    """How many micro-batches the local trainer computes at once (pure; tested directly).

    On the CPU with one intra-op thread: one per core, up to 4 and up to ``micro_batches``
    (each micro-batch's forward and backward runs on one thread, the gradients are then
    summed in micro-batch order, so the step is bitwise the sequential one). With more
    intra-op threads (``$SHOAL_TORCH_THREADS``) or on an accelerator: 1.
    """
    if device.type != "cpu" or intra_op != 1:
        return 1
    return max(1, min(4, cpu_cores() if cores is None else cores, micro_batches))


def cpu_cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


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
    parallel: int = 1  # micro-batches computed at once (see micro_batch_threads)


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
    batches = [get_micro_batch(data, "train", cfg.seed, step, mb, cfg.micro_batch_size, cfg.seq_len)
               for mb in range(m)]
    if prec.parallel > 1:
        losses = _parallel_grads(model, batches, m, scale, prec)
    else:
        losses = []
        for x, y in batches:
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


def warm_kernels(model: torch.nn.Module, prec: Precision, tokens: int = 8) -> None:
    """One forward and backward of a ``tokens``-long sequence of token 0 in the calling thread;
    changes no weight, gradient or random state.

    The local trainer calls it once before its first threaded step. Without it, the
    micro-batch threads of a process's first step make the process's first products at
    once, and sometimes (9 in 250 processes with four threads started together) one
    thread's micro-batch, or rarely every product after it, comes out in another summation
    order: other last bits than the same step computed one micro-batch at a time. After
    this warm-up, 0 in 250 (bench/bench_first_products.py; bench/results/exact.md).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.zeros((1, tokens), dtype=torch.long, device=prec.device)
    with autocast(prec.device, prec.precision):
        loss = model(ids, ids)
    torch.autograd.grad(loss, params, allow_unused=True)


def _parallel_grads(model: torch.nn.Module, batches: list, m: int, scale: float, prec: Precision) -> list[float]:
    """Gradients of one step into ``.grad``, ``prec.parallel`` micro-batches at a time.

    Each micro-batch's forward and backward runs on one thread (torch's intra-op threads
    are 1) and yields its own gradients (``torch.autograd.grad``); they are added in
    micro-batch order, ``((g_0 + g_1) + g_2) + ...``, which is what ``.backward()``
    accumulation computes one micro-batch after another. So the step is bitwise the
    sequential one, at ``prec.parallel`` times the activation memory and up to
    ``prec.parallel + 1`` gradient sets held at once.
    """
    from shoal.threads import compute_pool

    params = [p for p in model.parameters() if p.requires_grad]

    def one(xy) -> tuple[float, tuple]:
        x, y = xy
        with autocast(prec.device, prec.precision):
            loss = model(to_device(x, prec.device), to_device(y, prec.device))
        grads = torch.autograd.grad(scaled_share(loss, m, scale), params, allow_unused=True)
        return float(loss.detach()), grads

    losses: list[float] = []
    total: list[torch.Tensor | None] = [None] * len(params)
    with compute_pool(prec.parallel, "shoal-mb") as pool:
        ahead = [pool.submit(one, xy) for xy in batches[:prec.parallel]]
        for i in range(len(batches)):
            loss, grads = ahead.pop(0).result()
            if i + prec.parallel < len(batches):
                ahead.append(pool.submit(one, batches[i + prec.parallel]))
            losses.append(loss)
            for k, g in enumerate(grads):
                if g is None:
                    continue
                if total[k] is None:
                    total[k] = g
                else:
                    total[k].add_(g)
    for p, g in zip(params, total, strict=True):
        if g is not None:
            p.grad = g if p.grad is None else p.grad.add_(g)
    return losses


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


def train_local(cfg: TrainConfig, resume: bool = False, quiet: bool = False,
                tensorboard: str | None = None) -> TrainResult:
    """Train (or with ``resume`` continue) a run in ``cfg.out``; see the module docstring.
    ``tensorboard``: a folder to also write the step metrics to as TensorBoard event files."""
    cfg.validate()
    intra_op = set_torch_threads()
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
    prec = Precision(device, cfg.precision, initial_loss_scale(cfg.precision, scaling), 0, scaling,
                     micro_batch_threads(device, cfg.micro_batches, intra_op))

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
    if prec.parallel > 1 and start < end:
        warm_kernels(model, prec, min(8, cfg.seq_len))  # --seq-len is at most the model's length
    try:
        with JsonlWriter(out / METRICS_FILE, t0=t0, tensorboard=tensorboard) as writer, _StopRequest() as stop:
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
