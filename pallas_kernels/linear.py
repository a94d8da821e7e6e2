"""linear(x, w): y = x @ W^T for a dense, FP8 or NVFP4 weight, the one projection op.

On the GPU, weights read by few rows (decode; quantised weights up to QUANT_KERNEL_MAX_ROWS rows, dense
bf16/f16 ones up to DENSE_KERNEL_MAX_ROWS) run the Mosaic GPU kernel of _wgemm: the weight is streamed
once in its stored form and decoded in registers; activations are not quantised (W8A16 / W4A16).
Larger products (prefill) are compute-bound: the weight is dequantised once (the "xla" reference) and
multiplied by XLA's dot (cuBLAS), which beats the kernel there (on the H200 at 512 rows: 152 against
201 µs for the whole op).
A quantised weight with an input_scale quantises x first: FP8 runs W8A8 as one XLA dot of float8_e4m3fn
operands (fp32 accumulation; native FP8 tensor-core GEMMs on Hopper); NVFP4 emulates W4A4: x becomes its
exact e2m1 x e4m3 codes, which the weight-only kernel reads, and input_scale joins the output scale.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import reference
from pallas_kernels._backend import resolve_impl
from pallas_kernels._blocked import MMA_DTYPES, Tiling, block_rows, blocked_linear, row_blocks
from pallas_kernels.formats import FP8Weight, Weight, is_quantized

DENSE_KERNEL_MAX_ROWS = 64  # dense weights go through the kernel when x has at most this many rows
QUANT_KERNEL_MAX_ROWS = 256  # quantised weights likewise (the kernel reads 2-4x fewer bytes)


def _uses_kernel(w: Weight, rows: int) -> bool:
    if is_quantized(w):
        return rows <= QUANT_KERNEL_MAX_ROWS
    return w.dtype in MMA_DTYPES and rows <= DENSE_KERNEL_MAX_ROWS


def linear(x, w: Weight, *, impl: str | None = None, tiling: Tiling | None = None):
    """y = x @ dequant(W)^T with fp32 accumulation, in x.dtype.

    x [..., K] (bf16 / f16 / f32); w [N, K]: a dense array, FP8Weight or NVFP4Weight. Returns [..., N].
    """
    impl = resolve_impl(impl)
    *lead, k = x.shape
    m = math.prod(lead)
    if impl == "xla":
        return reference.linear(x, w)
    if isinstance(w, FP8Weight) and w.input_scale is not None:  # a native fp8 GEMM at any size
        return fp8_w8a8(x, w)
    if not _uses_kernel(w, m):
        return reference.linear(x, w)
    out_dtype = x.dtype
    if getattr(w, "input_scale", None) is not None:
        x, w = w.input_codes(x, w.input_scale), w.fold_input_scale()
    tm = block_rows(m)
    xb = row_blocks(x.reshape(m, k), tm, tiling)
    one_expert = jax.tree.map(lambda a: a[None], w)  # the kernel indexes weights by expert
    y = blocked_linear(xb, jnp.zeros(xb.shape[:1], jnp.int32), one_expert, impl, tiling, tm)
    return y.reshape(-1, y.shape[-1])[:m].astype(out_dtype).reshape(*lead, -1)


def fp8_w8a8(x, w: FP8Weight):
    """W8A8: e4m3 codes of x [..., K] times w.data [N, K] in one fp8 dot with fp32 accumulation, scaled by
    input_scale * scale -> [..., N] in x.dtype."""
    codes = w.input_codes(x, w.input_scale)
    y = lax.dot_general(codes, w.data, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * (w.input_scale * w.scale)).astype(x.dtype)

