"""Model configuration and named presets.

The model is an ordered list of ``n_layers + 2`` *layers*: layer 0 is the token
embedding, layers ``1..n_layers`` are transformer blocks and the last layer is the head
(final norm, output projection and loss). A stage is a contiguous range ``[first, last)``
of these layer indices.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from shoal.errors import ShoalError


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (pre-norm, RoPE, SwiGLU, untied head)."""

    name: str  # preset name, or "custom"
    vocab_size: int  # tokenizer vocabulary size (rows of the embedding and of the head)
    d_model: int  # hidden width
    n_layers: int  # number of transformer blocks (the model has n_layers + 2 layers)
    n_heads: int  # attention heads; d_model must be divisible by it
    ffn_hidden: int  # inner width of the SwiGLU MLP
    max_seq_len: int  # longest sequence the rotary tables are built for
    rope_base: float = 10000.0  # rotary position base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal initialisation of weight matrices

    @property
    def n_total_layers(self) -> int:
        """Number of layers including the embedding and the head."""
        return self.n_layers + 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        """Raise :class:`ShoalError` if the shape is inconsistent."""
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ShoalError(f"model {self.name}: {field} must be positive, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ShoalError(
                f"model {self.name}: d_model {self.d_model} is not divisible by n_heads {self.n_heads}"
            )
        if self.head_dim % 2:
            raise ShoalError(f"model {self.name}: head_dim {self.head_dim} must be even for rotary positions")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(**d)


def _swiglu_hidden(d_model: int, multiple: int = 64) -> int:
    """SwiGLU inner width with about the parameters of a 4*d GELU MLP, rounded up."""
    h = int(8 * d_model / 3)
    return multiple * ((h + multiple - 1) // multiple)


PRESETS: dict[str, ModelConfig] = {
    # ~1.3 M parameters: trains on a 2-core CPU in minutes; the tests and the demo use it.
    "tiny": ModelConfig("tiny", vocab_size=2048, d_model=128, n_layers=4, n_heads=4,
                        ffn_hidden=352, max_seq_len=256),
    # ~11 M parameters: a bigger CPU model for longer local runs.
    "small": ModelConfig("small", vocab_size=8192, d_model=256, n_layers=6, n_heads=8,
                         ffn_hidden=_swiglu_hidden(256), max_seq_len=512),
    # GPT-3 family shapes (Brown et al. 2020, table 2.1) with a SwiGLU MLP.
    "gpt-125m": ModelConfig("gpt-125m", vocab_size=50304, d_model=768, n_layers=12, n_heads=12,
                            ffn_hidden=_swiglu_hidden(768), max_seq_len=2048),
    "gpt-350m": ModelConfig("gpt-350m", vocab_size=50304, d_model=1024, n_layers=24, n_heads=16,
                            ffn_hidden=_swiglu_hidden(1024), max_seq_len=2048),
    "gpt-1.3b": ModelConfig("gpt-1.3b", vocab_size=50304, d_model=2048, n_layers=24, n_heads=16,
                            ffn_hidden=_swiglu_hidden(2048), max_seq_len=2048),
    # LLaMA-7B shape (Touvron et al. 2023).
    "llama-7b": ModelConfig("llama-7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                            ffn_hidden=11008, max_seq_len=2048),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """Return the preset called ``name`` (with optional field overrides), validated."""
    if name not in PRESETS:
        raise ShoalError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    cfg = replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
    cfg.validate()
    return cfg


def layer_kind(cfg: ModelConfig, index: int) -> str:
    """Return ``"embedding"``, ``"block"`` or ``"head"`` for a global layer index."""
    if index == 0:
        return "embedding"
    if index == cfg.n_layers + 1:
        return "head"
    if 0 < index <= cfg.n_layers:
        return "block"
    raise ShoalError(f"layer index {index} out of range [0, {cfg.n_total_layers})")
