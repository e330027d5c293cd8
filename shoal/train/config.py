"""Configuration of a local training run, importable without torch (the CLI reads its
defaults to build ``--help``); the heavy modules are imported only when used."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError
from shoal.train.flags import DEFAULTS as W

if TYPE_CHECKING:
    from shoal.data import DataConfig
    from shoal.model.config import ModelConfig
    from shoal.train.optim import OptimConfig

# Default tokens per sequence (the tiny model's max_seq_len is 256); shared by every command.
DEFAULT_SEQ_LEN = W.seq_len


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a local training run (validated in one place)."""

    # The workload fields and their defaults are shoal.train.flags.Workload's (one definition).
    model: str = W.model  # model preset name (shoal.model.config.PRESETS)
    steps: int = W.steps  # optimizer steps in the run (sets the learning-rate schedule)
    micro_batches: int = W.micro_batches  # M: micro-batches per step
    micro_batch_size: int = W.micro_batch_size  # B: sequences per micro-batch
    seq_len: int = W.seq_len  # T: tokens per sequence
    seed: int = W.seed  # seeds the weights (per layer) and the data order (per micro-batch)
    lr: float = W.lr  # peak learning rate
    min_lr: float | None = W.min_lr  # final learning rate of the cosine decay; None = lr / 10
    warmup: int = W.warmup  # linear warm-up steps
    weight_decay: float = W.weight_decay  # AdamW weight decay on matrices
    grad_clip: float = W.grad_clip  # global gradient-norm clip (0 = off)
    eval_every: int = 50  # validation every K steps (and after the last step); 0 = only at the end
    eval_batches: int = 8  # fixed validation micro-batches per evaluation
    checkpoint_every: int = 0  # checkpoint every K steps; 0 = only at the end
    data: tuple[str, ...] = ()  # a prepared data folder, or text files/folders/globs; empty = bundled corpus
    init_from: str | None = None  # Hugging Face Llama folder to start from (sets the model shape)
    val_fraction: float = 0.05  # last fraction of the tokens kept for validation
    cache_dir: str | None = None  # tokenizer cache; None = $SHOAL_CACHE_DIR or ~/.cache/shoal
    out: str = "runs/local"  # run folder (metrics.jsonl, tokenizer.json, checkpoint/)
    stop_after: int | None = None  # stop (and checkpoint) after this many steps, as if interrupted
    log_every: int = 10  # without a terminal, print a progress line every this many steps
    device: str = "auto"  # auto, cpu, cuda or cuda:N (auto: the first CUDA device, else the CPU)
    precision: str = "fp32"  # fp32, or bf16/fp16 under autocast with fp32 weights and AdamW state
    loss_scale: float | None = None  # fp16: initial dynamic loss scale (None: LossScaleConfig's)

    def model_config(self) -> ModelConfig:
        """The model preset, or the shape of the ``init_from`` model (raises for an unknown name)."""
        from shoal.model.config import get_preset

        if self.init_from:
            from shoal.hf.convert import read_hf_model_config

            return read_hf_model_config(self.init_from)
        return get_preset(self.model)

    def optim_config(self) -> OptimConfig:
        """The shared optimizer configuration of this run."""
        from shoal.train.optim import OptimConfig

        min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        return OptimConfig(lr=self.lr, min_lr=min_lr, warmup_steps=self.warmup,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip)

    def data_config(self) -> DataConfig:
        """The data configuration of this run."""
        from shoal.data import DataConfig

        paths = () if tuple(self.data) == ("corpus",) else tuple(self.data)  # "corpus": the runtime's name
        return DataConfig(paths=paths, val_fraction=self.val_fraction, cache_dir=self.cache_dir)

    def loss_scale_config(self):
        """The fp16 dynamic loss scaling of this run (see :mod:`shoal.train.precision`)."""
        from shoal.train.precision import LossScaleConfig

        return LossScaleConfig() if self.loss_scale is None else LossScaleConfig(init_scale=self.loss_scale)

    def validate(self) -> None:
        """Raise :class:`ShoalError` with a one-line message for any bad field."""
        cfg = self.model_config()
        for name in ("steps", "micro_batches", "micro_batch_size", "seq_len", "eval_batches", "log_every"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ShoalError(f"{flag} must be positive, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "warmup"):
            if getattr(self, name) < 0:
                raise ShoalError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.seq_len > cfg.max_seq_len:
            raise ShoalError(f"--seq-len {self.seq_len} exceeds the {cfg.name} model's max_seq_len {cfg.max_seq_len}")
        if self.stop_after is not None and not 0 < self.stop_after <= self.steps:
            raise ShoalError(f"--stop-after must be in [1, --steps={self.steps}], got {self.stop_after}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ShoalError(f"--lr must be positive, got {self.lr}")
        self.optim_config().validate()
        from shoal.train.precision import check_precision

        check_precision(self.precision)
        if self.loss_scale is not None and not (math.isfinite(self.loss_scale) and self.loss_scale >= 1):
            raise ShoalError(f"--loss-scale must be a finite number >= 1, got {self.loss_scale}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ShoalError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["data"] = list(self.data)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "data" in kw:
            kw["data"] = tuple(kw["data"])
        return cls(**kw)
