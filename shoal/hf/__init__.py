"""Hugging Face interchange: export a run as a Llama-architecture model, start from one.

shoal's transformer is the Llama architecture (pre-norm RMSNorm, rotary positions with
the half-split rotation, SwiGLU MLP, untied head, no biases); only the parameter names
and the fused q/k/v matrix differ. :mod:`shoal.hf.convert` maps between the two name
spaces exactly (a round trip is bit-identical); nothing here imports ``transformers``.
"""

from shoal.hf.convert import (
    hf_to_shoal,
    load_hf_dir,
    model_config_from_hf,
    shoal_to_hf,
    write_hf_dir,
)

__all__ = ["hf_to_shoal", "load_hf_dir", "model_config_from_hf", "shoal_to_hf", "write_hf_dir"]
