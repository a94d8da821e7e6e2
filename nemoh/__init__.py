"""nemoh: JAX/XLA inference for NVIDIA NemotronH hybrid models (Mamba2 + attention + MoE)."""

from nemoh.compile_cache import enable_default_cache, set_compilation_cache
from nemoh.config import NemotronHConfig
from nemoh.errors import (CacheCapacityError, CheckpointError, ConfigError, LayerError, NemohError,
                          NonFiniteError, RequestError, StaleCarryError)
from nemoh.io.loader import load
from nemoh.io.persist import save
from nemoh.io.save_hf import save_hf
from nemoh.engine.kv_pages import CacheSpec
from nemoh.generate import generate
from nemoh import surgery
from nemoh.layers.protocol import Layer, StateShape, Stateless
from nemoh.model import ModelParams, forward
from nemoh.random_params import random_params
from nemoh.text import Tokenizer, generate_text, load_tokenizer

enable_default_cache()

__all__ = [
    "set_compilation_cache",
    "NemotronHConfig", "ModelParams", "CacheSpec", "load", "save", "save_hf", "random_params", "forward", "generate",
    "surgery", "Layer", "StateShape", "Stateless", "Tokenizer", "load_tokenizer", "generate_text",
    "NemohError", "ConfigError", "CheckpointError", "CacheCapacityError", "RequestError", "NonFiniteError", "LayerError",
    "StaleCarryError",
]
