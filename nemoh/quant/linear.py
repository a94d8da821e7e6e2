"""linear(x, w): the one call site through which every projection runs, whatever the weight type."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nemoh.quant.types import FP8Weight, NVFP4Weight, Weight


def linear(x: jax.Array, w: Weight) -> jax.Array:
    """y = x @ W^T for x [..., in] and W [out, in] (dense, FP8 or NVFP4); y [..., out] in x.dtype.

    Dense weights use XLA's dot with fp32 accumulation. Quantised weights go through the kernels
    in pallas_kernels (weight-only: activations stay in x.dtype).
    """
    if isinstance(w, FP8Weight):
        from pallas_kernels import fp8_matmul

        return fp8_matmul(x, w.data, w.scale)
    if isinstance(w, NVFP4Weight):
        from pallas_kernels import nvfp4_matmul

        return nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
