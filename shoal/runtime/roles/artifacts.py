"""Files a distributed run leaves in its folder, in the local trainer's layout.

``DIR/checkpoint/`` (the full model's weights under global parameter names, written by
:func:`shoal.train.checkpoint.save_checkpoint`), ``DIR/tokenizer.json``,
``DIR/config.json`` and ``DIR/summary.json``; ``metrics.jsonl`` and ``events.jsonl``
are appended by the coordinator while the run goes. The coordinator writes them into
the run's own folder ``OUT/runs/<run id>/`` and links ``OUT/<name>`` to them (see
:mod:`shoal.runtime.safety.journal`), so ``shoal generate --from OUT`` works on a runtime run
exactly as on a local one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from shoal.model.config import ModelConfig
from shoal.net import shoal_pb2 as pb
from shoal.train.metrics import read_jsonl


def spec_to_train_config(spec: pb.RunSpec, out: Path) -> dict:
    """The run's settings in the local trainer's config vocabulary."""
    return {
        "model": spec.model, "steps": int(spec.steps), "micro_batches": spec.micro_batches,
        "micro_batch_size": spec.micro_batch_size, "seq_len": spec.seq_len, "seed": int(spec.seed),
        "lr": spec.lr, "min_lr": spec.min_lr, "warmup": spec.warmup, "weight_decay": spec.weight_decay,
        "grad_clip": spec.grad_clip, "out": str(out),
        "data": [] if spec.data in ("corpus", "synthetic") else [spec.data],
        "init_from": spec.init_from or None,
    }


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_final(out: Path, weights: dict[str, torch.Tensor], cfg: ModelConfig, spec: pb.RunSpec,
                summary: dict) -> None:
    """Write the merged final weights, tokenizer, config and summary into ``out``."""
    from shoal.train.checkpoint import save_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    config = spec_to_train_config(spec, out)
    records = read_jsonl(out / "metrics.jsonl")
    if weights:
        save_checkpoint(out / "checkpoint", weights, {},
                        {"step": int(spec.steps), "config": config, "model_config": cfg.to_dict(),
                         "metrics": records, "runtime": True})
    if spec.data != "synthetic":
        try:
            from shoal.data import DataConfig, load_data

            data = load_data(DataConfig(paths=() if spec.data == "corpus" else (spec.data,)), cfg.vocab_size)
            _atomic_text(out / "tokenizer.json", data.tokenizer.to_str())
        except Exception as exc:  # the weights matter more than the tokenizer copy
            summary["tokenizer_error"] = repr(exc)
    _atomic_text(out / "config.json", json.dumps({"config": config, "model_config": cfg.to_dict()},
                                                 indent=1, sort_keys=True))
    _atomic_text(out / "summary.json", json.dumps(summary, indent=1, sort_keys=True))


def load_final_weights(out: str | Path) -> dict[str, torch.Tensor]:
    """The final full-model weights of a run folder (runtime or local trainer)."""
    from shoal.train.checkpoint import load_checkpoint

    return dict(load_checkpoint(Path(out) / "checkpoint").model_state)
