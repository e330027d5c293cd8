"""The newest committed weights of a run folder, local or distributed, and their export.

Candidates, newest step wins:

* ``RUN/checkpoint/`` -- the local trainer's checkpoint, or a distributed run's merged
  final weights (its ``state.json`` holds the step);
* ``RUN/server_ckpt/stage*/v<N>.safetensors`` -- a distributed run's stage-server
  checkpoints (``shoal launch`` puts them there): a version ``N`` present for every stage
  whose parameters together cover the whole model is a committed step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from shoal.errors import ShoalError
from shoal.model.config import ModelConfig

_VERSION = re.compile(r"^v(\d+)\.safetensors$")


def _model_config(run: Path) -> ModelConfig:
    for f in (run / "config.json", run / "checkpoint" / "state.json"):
        if f.is_file():
            d = json.loads(f.read_text())
            if "model_config" in d:
                return ModelConfig.from_dict(d["model_config"])
    raise ShoalError(f"{str(run)!r} has no config.json with a model_config; is it a shoal run folder?")


def _server_candidates(run: Path, names: set[str]) -> list[tuple[int, list[Path]]]:
    """(version, files) for every version that all stage folders have and that covers ``names``."""
    stages = sorted(d for d in (run / "server_ckpt").glob("stage*") if d.is_dir())
    if not stages:
        return []
    versions = None
    for d in stages:
        vs = {int(m.group(1)) for p in d.iterdir() if (m := _VERSION.match(p.name))}
        versions = vs if versions is None else versions & vs
    return [(v, [d / f"v{v}.safetensors" for d in stages]) for v in sorted(versions or (), reverse=True)]


def latest_weights(run_dir: str | Path) -> tuple[int, ModelConfig, dict[str, torch.Tensor]]:
    """(step, model config, full state dict) of the newest committed step in ``run_dir``."""
    from safetensors import safe_open

    from shoal.model.transformer import build_stage
    from shoal.train.checkpoint import load_checkpoint

    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise ShoalError(f"run folder {str(run_dir)!r} does not exist")
    cfg = _model_config(run)
    with torch.device("meta"):
        names = {n for n, _ in build_stage(cfg, 0, cfg.n_total_layers, init=False).named_parameters()}
    best: tuple[int, dict] | None = None
    if (run / "checkpoint").exists():
        ck = load_checkpoint(run / "checkpoint")
        if set(ck.model_state) == names:
            best = (int(ck.state["step"]), ck.model_state)
    for version, files in _server_candidates(run, names):
        if best is not None and version <= best[0]:
            break
        state: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():  # noqa: SIM118 -- safe_open has keys(), not iteration
                    if key.startswith("param/"):
                        state[key[len("param/"):]] = sf.get_tensor(key)
        if set(state) == names:
            best = (version, state)
            break
    if best is None:
        raise ShoalError(f"{str(run)!r} holds no complete checkpoint yet; export after at least one committed step")
    return best[0], cfg, best[1]


def export_caveat(spec: dict, step: int) -> str:
    """What a user should know of the weights of ``step`` from a run whose journal holds
    ``spec`` (pure; "" for nothing): in local mode with ``sparse`` or ``lowrank`` pushes the replicas keep what
    their pushes left until the run's last, dense round, so merged weights from before it trail
    the replicas (docs/sync-runtime.md)."""
    steps = int(spec.get("steps") or 0)
    if (spec.get("sync_mode") == "local" and str(spec.get("compress_push", "")).startswith(("sparse", "lowrank"))
            and step < steps):
        return (f"step {step} is before the run's last, dense round ({steps}): with sparse or lowrank pushes these merged "
                "weights trail the replicas' until then (docs/sync-runtime.md)")
    return ""


def _journal_spec(run: Path) -> dict:
    """The run spec the run's journal opens with ({} without a readable journal)."""
    try:
        with open(run / "journal.jsonl") as f:
            return json.loads(f.readline()).get("spec") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def export_hf(run_dir: str | Path, out: str | Path) -> dict:
    """Write the newest committed weights of ``run_dir`` as a Hugging Face Llama folder."""
    from shoal.hf.convert import write_hf_dir

    run = Path(run_dir).expanduser()
    step, cfg, state = latest_weights(run)
    tok = run / "tokenizer.json"
    tokenizer_json = tok.read_text() if tok.is_file() else None
    write_hf_dir(out, state, cfg, tokenizer_json, extra={"step": step, "run": str(run.resolve()),
                                                         "model": cfg.name})
    return {"step": step, "out": str(out), "tokenizer": tokenizer_json is not None,
            "parameters": sum(v.numel() for v in state.values()), "caveat": export_caveat(_journal_spec(run), step)}
