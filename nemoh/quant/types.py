"""Weight types held in params: a plain array (dense), FP8Weight, or NVFP4Weight.

All three keep the Hugging Face layout [..., out, in] (leading dims stack experts). Quantised weights
stay packed in memory; `dequantize` is the jnp reference every kernel is checked against.
Formats (NVIDIA ModelOpt): ../shared/reference/quant_formats.md.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

NVFP4_BLOCK = 16
FP8_MAX = 448.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Weight:
    """Per-tensor FP8 (e4m3fn) weight: W = float(data) * scale.

    data: float8_e4m3fn [..., out, in]; scale: float32 [...] (one per tensor, per expert when stacked).
    """

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    """NVFP4 weight: W[o, k] = e2m1(code[o, k]) * float(block_scale[o, k // 16]) * global_scale.

    packed: uint8 [..., out, in/2], element 2j in the low nibble, 2j+1 in the high nibble;
    block_scale: float8_e4m3fn [..., out, in/16]; global_scale: float32 [...].
    """

    packed: jax.Array
    block_scale: jax.Array
    global_scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, half = self.packed.shape
        return (*lead, out, 2 * half)


Weight = Union[jax.Array, FP8Weight, NVFP4Weight]


def weight_shape(w: Weight) -> tuple[int, ...]:
    """Logical [..., out, in] shape of any weight type."""
    return tuple(w.shape)


def unpack_e2m1(packed: jax.Array) -> jax.Array:
    """uint8 [..., n/2] -> float32 [..., n] e2m1 values (low nibble first)."""
    table = jnp.asarray(E2M1_VALUES)
    lo = table[(packed & 0xF).astype(jnp.int32)]
    hi = table[(packed >> 4).astype(jnp.int32)]
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize(w: Weight, dtype=jnp.float32) -> jax.Array:
    """Reference dequantisation of any weight type to a dense [..., out, in] array of `dtype`."""
    if isinstance(w, FP8Weight):
        scale = w.scale.astype(jnp.float32)[..., None, None]
        return (w.data.astype(jnp.float32) * scale).astype(dtype)
    if isinstance(w, NVFP4Weight):
        values = unpack_e2m1(w.packed)
        scales = jnp.repeat(w.block_scale.astype(jnp.float32), NVFP4_BLOCK, axis=-1)
        glob = w.global_scale.astype(jnp.float32)[..., None, None]
        return (values * scales * glob).astype(dtype)
    return jnp.asarray(w).astype(dtype)
