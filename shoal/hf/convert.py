"""Exact name/shape mapping between shoal's state dict and a ``LlamaForCausalLM`` one.

shoal layer ``i`` (1..n) is Llama decoder layer ``i - 1``; layer 0 is the embedding and
layer ``n + 1`` the final norm and head. shoal fuses q, k and v into one ``wqkv`` matrix
(rows q, then k, then v, each head-major), which is exactly Llama's three projections
stacked, so the mapping only concatenates or slices rows: no arithmetic, bit-identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shoal.errors import ShoalError
from shoal.model.config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Name of imported model configs (not a preset: the shape comes from the folder).
HF_MODEL_NAME = "hf"

# shoal block parameter suffix -> Llama decoder-layer suffix (1:1 copies).
_BLOCK = {
    "norm1.weight": "input_layernorm.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def hf_config(cfg: ModelConfig, eot_id: int | None = None) -> dict:
    """The ``config.json`` of a Llama model with ``cfg``'s shape."""
    d = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": cfg.init_std, "dtype": "float32", "torch_dtype": "float32",
        "pretraining_tp": 1, "attention_dropout": 0.0, "use_cache": True,
    }
    if eot_id is not None:
        d["bos_token_id"] = d["eos_token_id"] = eot_id
    return d


def model_config_from_hf(d: dict) -> ModelConfig:
    """A shoal :class:`ModelConfig` from a Llama ``config.json``; raises for what shoal lacks."""
    if d.get("model_type") != "llama":
        raise ShoalError(f"the model is a {d.get('model_type')!r}, not a 'llama'; shoal starts only from Llama-architecture models")
    try:
        heads = int(d["num_attention_heads"])
        kv = int(d.get("num_key_value_heads") or heads)
        hidden = int(d["hidden_size"])
        if kv != heads:
            raise ShoalError(f"the model uses grouped-query attention ({kv} key/value heads for {heads}); shoal needs equal counts")
        if d.get("head_dim") not in (None, hidden // heads):
            raise ShoalError(f"head_dim {d['head_dim']} differs from hidden_size / heads; shoal does not support that")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ShoalError("the model has attention or MLP biases; shoal's layers have none")
        if d.get("hidden_act", "silu") != "silu":
            raise ShoalError(f"the model's activation is {d['hidden_act']!r}; shoal's MLP is SwiGLU (silu)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ShoalError(f"the model uses {rope.get('rope_type', rope.get('type'))!r} rope scaling; shoal has plain rotary positions")
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        cfg = ModelConfig(HF_MODEL_NAME, vocab_size=int(d["vocab_size"]), d_model=hidden,
                          n_layers=int(d["num_hidden_layers"]), n_heads=heads,
                          ffn_hidden=int(d["intermediate_size"]), max_seq_len=int(d["max_position_embeddings"]),
                          rope_base=theta, norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                          init_std=float(d.get("initializer_range", 0.02)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ShoalError(f"the model's config.json lacks or mangles {exc}; is it a transformers Llama config?") from None
    cfg.validate()
    return cfg


def shoal_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A full shoal state dict (global names) as a ``LlamaForCausalLM`` state dict."""
    n, d = cfg.n_layers, cfg.d_model
    out = {"model.embed_tokens.weight": state["layers.0.tok.weight"],
           "model.norm.weight": state[f"layers.{n + 1}.norm.weight"],
           "lm_head.weight": state[f"layers.{n + 1}.out.weight"]}
    for i in range(1, n + 1):
        pre = f"model.layers.{i - 1}."
        for ours, theirs in _BLOCK.items():
            out[pre + theirs] = state[f"layers.{i}.{ours}"]
        qkv = state[f"layers.{i}.attn.wqkv.weight"]
        for j, name in enumerate(_QKV):
            out[pre + name] = qkv[j * d : (j + 1) * d]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def hf_to_shoal(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict as a full shoal state dict (float32)."""
    n = cfg.n_layers

    def get(name: str) -> torch.Tensor:
        if name not in state:
            if name == "lm_head.weight" and "model.embed_tokens.weight" in state:
                return state["model.embed_tokens.weight"]  # tied embeddings: the head is the embedding
            raise ShoalError(f"the model's weights lack {name!r}")
        return state[name]

    out = {"layers.0.tok.weight": get("model.embed_tokens.weight"),
           f"layers.{n + 1}.norm.weight": get("model.norm.weight"),
           f"layers.{n + 1}.out.weight": get("lm_head.weight")}
    for i in range(1, n + 1):
        pre = f"model.layers.{i - 1}."
        for ours, theirs in _BLOCK.items():
            out[f"layers.{i}.{ours}"] = get(pre + theirs)
        out[f"layers.{i}.attn.wqkv.weight"] = torch.cat([get(pre + q) for q in _QKV], dim=0)
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def _read_config(root: Path) -> dict:
    try:
        return json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ShoalError(f"{str(root)!r} is not a Hugging Face model folder ({CONFIG_FILE}: {exc})") from None


def read_hf_model_config(path: str | Path) -> ModelConfig:
    """The shoal model config of the Llama model in folder ``path`` (weights not read)."""
    return model_config_from_hf(_read_config(Path(path).expanduser()))


def load_hf_dir(path: str | Path, names: set[str] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Model config and shoal state dict of a Llama model folder (``model.safetensors`` or
    a sharded ``model.safetensors.index.json``); ``names`` keeps only those shoal parameters."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path).expanduser()
    cfg = model_config_from_hf(_read_config(root))
    files = [root / WEIGHTS_FILE]
    if not files[0].is_file() and (root / WEIGHTS_INDEX).is_file():
        index = json.loads((root / WEIGHTS_INDEX).read_text())
        files = [root / f for f in sorted(set(index["weight_map"].values()))]
    hf_state: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            hf_state.update(load_file(str(f)))
    except (OSError, SafetensorError) as exc:
        raise ShoalError(f"cannot read the weights in {str(root)!r} ({exc}); shoal reads model.safetensors") from None
    state = hf_to_shoal(hf_state, cfg)
    if names is not None:
        state = {k: v for k, v in state.items() if k in names}
    return cfg, state


def write_hf_dir(out: str | Path, state: dict[str, torch.Tensor], cfg: ModelConfig,
                 tokenizer_json: str | None = None, extra: dict | None = None) -> Path:
    """Write a transformers-loadable Llama folder: config, safetensors weights, tokenizer files."""
    from safetensors.torch import save_file

    from shoal.data.tokens import EOT_TOKEN

    root = Path(out).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    eot = None
    if tokenizer_json is not None:
        eot = json.loads(tokenizer_json)
        eot = next((t["id"] for t in eot.get("added_tokens", []) if t.get("content") == EOT_TOKEN), None)
    config = hf_config(cfg, eot)
    if extra:
        config["shoal"] = extra
    save_file(shoal_to_hf(state, cfg), str(root / WEIGHTS_FILE), metadata={"format": "pt"})
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    if eot is not None:
        (root / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": eot, "eos_token_id": eot}, indent=1) + "\n")
    if tokenizer_json is not None:
        (root / "tokenizer.json").write_text(tokenizer_json)
        special = {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "unk_token": EOT_TOKEN}
        (root / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
             "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
             **special}, indent=1) + "\n")
        (root / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")
    return root
