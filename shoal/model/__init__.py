"""The stage-splittable transformer, its presets and its analytic profile.

``Stage`` and ``build_stage`` need torch and are imported on first use, so the planner (which
only needs the presets and the profile) never imports torch.
"""

from shoal.model.config import PRESETS, ModelConfig, get_preset, layer_kind
from shoal.model.profile import LayerProfile, ModelProfile, profile_model

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


def __getattr__(name: str):
    if name in ("Stage", "build_stage"):
        from shoal.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'shoal.model' has no attribute {name!r}")
