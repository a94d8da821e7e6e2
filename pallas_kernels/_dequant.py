"""Weight decoding shared by every kernel body: NVFP4 nibbles and FP8 codes -> exact float16 values.

Plain jnp on arrays, so the same code runs inside a Mosaic GPU kernel (register values), in interpret
mode and on ordinary arrays (tests). float16 because this ptxas refuses f8 -> bf16 casts, and because
e2m1 x e4m3 products (at most 5 significant bits, |v| <= 6 * 448) are exact in float16.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# ((v & 7) << 9) | ((v & 8) << 12) is the float16 bit pattern of e2m1(v) * 2**-14 (subnormals included).
_E2M1_F16_UNIT = 2.0**14


def _e2m1_bits_to_f16(bits: jnp.ndarray) -> jnp.ndarray:
    return lax.bitcast_convert_type(bits, jnp.float16) * jnp.float16(_E2M1_F16_UNIT)


def e2m1_pair_to_f16(packed: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """uint8 [..., j] of two e2m1 codes -> (low-nibble values, high-nibble values), float16 [..., j].

    The low nibble holds logical element 2j, the high nibble element 2j+1 (ModelOpt layout).
    """
    p = packed.astype(jnp.uint16)
    lo = ((p << 9) & 0x0E00) | ((p << 12) & 0x8000)
    hi = ((p << 5) & 0x0E00) | ((p << 8) & 0x8000)
    return _e2m1_bits_to_f16(lo), _e2m1_bits_to_f16(hi)


def fp8_to_f16(data: jnp.ndarray) -> jnp.ndarray:
    """float8_e4m3fn -> float16 (exact; NaN stays NaN)."""
    return data.astype(jnp.float16)


def scale_column_chunks(values: jnp.ndarray, scales: list[jnp.ndarray], chunk: int) -> jnp.ndarray:
    """values [rows, chunk * len(scales)] times scales[c] [rows] on columns [c*chunk, (c+1)*chunk).

    Broadcasting per chunk and concatenating keeps Mosaic's register layout (chunk = 8 is one WGMMA
    layout tile), so no data moves between threads.
    """
    rows = values.shape[0]
    parts = [
        values[:, c * chunk:(c + 1) * chunk] * lax.broadcast_in_dim(s, (rows, chunk), (0,))
        for c, s in enumerate(scales)
    ]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
