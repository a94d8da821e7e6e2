"""nemoh: JAX/XLA inference for NVIDIA NemotronH hybrid models (Mamba2 + attention + MoE)."""

from nemoh.config import NemotronHConfig
from nemoh.errors import (CacheCapacityError, CheckpointError, ConfigError, NemohError, NonFiniteError,
                          RequestError, StaleCarryError)
from nemoh.io.loader import load
from nemoh.engine.kv_pages import CacheSpec
from nemoh.generate import generate
from nemoh.model import ModelParams, forward, register_mixer

__all__ = [
    "NemotronHConfig", "ModelParams", "CacheSpec", "load", "forward", "generate", "register_mixer",
    "NemohError", "ConfigError", "CheckpointError", "CacheCapacityError", "RequestError", "NonFiniteError",
    "StaleCarryError",
]
