"""Sampling text from a trained run folder (``shoal generate``)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from shoal.errors import ShoalError
from shoal.model.config import ModelConfig
from shoal.model.transformer import Stage, build_stage
from shoal.train.checkpoint import load_checkpoint
from shoal.train.local import CHECKPOINT_DIR, TOKENIZER_FILE


def load_run(run_dir: str | Path) -> tuple[Stage, Tokenizer, dict]:
    """The model (eval mode), tokenizer and checkpoint state of a run folder."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ShoalError(f"run folder {str(run)!r} does not exist; pass the --out folder of a training run")
    if not (run / TOKENIZER_FILE).exists():
        raise ShoalError(f"{str(run)!r} has no {TOKENIZER_FILE}; is it a shoal training run folder?")
    ck = load_checkpoint(run / CHECKPOINT_DIR)
    model_cfg = ModelConfig.from_dict(ck.state["model_config"])
    first = min(int(k.split(".")[1]) for k in ck.model_state)
    last = max(int(k.split(".")[1]) for k in ck.model_state) + 1
    if (first, last) != (0, model_cfg.n_total_layers):
        raise ShoalError(f"checkpoint holds layers [{first}, {last}), not the whole model; merge the stage checkpoints first")
    model = build_stage(model_cfg, 0, model_cfg.n_total_layers, init=False)
    model.load_state_dict(ck.model_state, strict=True)
    model.eval()
    return model, Tokenizer.from_file(str(run / TOKENIZER_FILE)), ck.state


@torch.no_grad()
def sample(
    model: Stage, prompt_ids: list[int], tokens: int, temperature: float = 0.8, top_k: int = 0, seed: int = 0
) -> list[int]:
    """Continue ``prompt_ids`` by ``tokens`` tokens (temperature 0 = greedy); returns the new ids."""
    if tokens < 0:
        raise ShoalError(f"--tokens must be >= 0, got {tokens}")
    if temperature < 0:
        raise ShoalError(f"--temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ShoalError(f"--top-k must be >= 0, got {top_k}")
    gen = torch.Generator().manual_seed(seed)
    window = model.cfg.max_seq_len
    ids = list(prompt_ids) or [0]  # an empty prompt starts from the end-of-text token
    new: list[int] = []
    for _ in range(tokens):
        x = torch.tensor([ids[-window:]], dtype=torch.int64)
        logits = model(x)[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids.append(nxt)
        new.append(nxt)
    return new


def generate_text(run_dir: str | Path, prompt: str, tokens: int = 200, temperature: float = 0.8,
                  top_k: int = 0, seed: int = 0) -> str:
    """Prompt plus a sampled continuation from the checkpoint of ``run_dir``."""
    model, tok, _ = load_run(run_dir)
    prompt_ids = tok.encode(prompt).ids
    new = sample(model, prompt_ids, tokens, temperature, top_k, seed)
    return prompt + tok.decode(new)
