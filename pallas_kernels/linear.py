"""linear(x, w): y = x @ W^T for a dense, FP8 or NVFP4 weight, the one projection op.

On the GPU quantised weights, and dense bf16/f16 weights read by few rows (decode), run the Mosaic GPU
kernel of _wgemm: the weight is streamed once in its stored form and decoded in registers; activations
are not quantised (W8A16 / W4A16). Larger dense products (prefill) use XLA's dot (cuBLAS).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels._backend import resolve_impl
from pallas_kernels._blocked import MMA_DTYPES, Tiling, block_rows, blocked_linear
from pallas_kernels.formats import Weight, is_quantized

DENSE_KERNEL_MAX_ROWS = 64  # dense weights go through the kernel when x has at most this many rows


def _uses_kernel(w: Weight, rows: int) -> bool:
    return is_quantized(w) or (w.dtype in MMA_DTYPES and rows <= DENSE_KERNEL_MAX_ROWS)


def linear(x, w: Weight, *, impl: str | None = None, tiling: Tiling | None = None):
    """y = x @ dequant(W)^T with fp32 accumulation, in x.dtype.

    x [..., K] (bf16 / f16 / f32); w [N, K]: a dense array, FP8Weight or NVFP4Weight. Returns [..., N].
    """
    impl = resolve_impl(impl)
    *lead, k = x.shape
    m = math.prod(lead)
    if impl == "xla" or not _uses_kernel(w, m):
        return reference.linear(x, w)
    tm = block_rows(m)
    num_blocks = -(-m // tm)
    xb = jnp.pad(x.reshape(m, k), ((0, num_blocks * tm - m), (0, 0))).reshape(num_blocks, tm, k)
    one_expert = jax.tree.map(lambda a: a[None], w)  # the kernel indexes weights by expert
    y = blocked_linear(xb, jnp.zeros((num_blocks,), jnp.int32), one_expert, impl, tiling)
    return y.reshape(num_blocks * tm, -1)[:m].astype(x.dtype).reshape(*lead, -1)

