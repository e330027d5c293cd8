"""The stage-splittable transformer, its presets and its analytic profile."""

from shoal.model.config import PRESETS, ModelConfig, get_preset
from shoal.model.profile import LayerProfile, ModelProfile, profile_model
from shoal.model.transformer import Stage, build_stage, layer_kind

__all__ = [
    "PRESETS",
    "LayerProfile",
    "ModelConfig",
    "ModelProfile",
    "Stage",
    "build_stage",
    "get_preset",
    "layer_kind",
    "profile_model",
]
