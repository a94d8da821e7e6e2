"""nemoh: JAX/XLA inference for NVIDIA NemotronH hybrid models (Mamba2 + attention + MoE)."""

from nemoh.config import NemotronHConfig
from nemoh.errors import (CacheCapacityError, CheckpointError, ConfigError, NemohError, RequestError,
                          StaleCarryError)
from nemoh.io.loader import load
from nemoh.model import ModelParams, forward, register_mixer

__all__ = [
    "NemotronHConfig", "ModelParams", "load", "forward", "register_mixer",
    "NemohError", "ConfigError", "CheckpointError", "CacheCapacityError", "RequestError", "StaleCarryError",
]
