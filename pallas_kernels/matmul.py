"""Weight-only quantised projections: nvfp4_matmul (W4A16) and fp8_matmul (W8A16).

Both run the Mosaic GPU kernel of _wgemm (lowering: Mosaic GPU, plgpu.kernel) on GPU: the weight is
read once in its packed form and decoded in registers; activations stay unquantised.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels._backend import resolve_impl
from pallas_kernels._blocked import Tiling, block_rows, blocked_linear
from nemoh.quant.types import FP8Weight, NVFP4Weight


def _run_blocked(x, w, impl: str, tiling: Tiling):
    """x [..., K] @ W[N, K]^T via blocks of rows, in x.dtype."""
    *lead, k = x.shape
    m = math.prod(lead)
    tm = block_rows(m)
    num_blocks = -(-m // tm)
    xb = jnp.pad(x.reshape(m, k), ((0, num_blocks * tm - m), (0, 0))).reshape(num_blocks, tm, k)
    y = blocked_linear(xb, jnp.zeros((num_blocks,), jnp.int32), _with_expert_axis(w), impl, tiling)
    return y.reshape(num_blocks * tm, -1)[:m].astype(x.dtype).reshape(*lead, -1)


def _with_expert_axis(w):
    """Add a leading expert axis of 1 to a single weight."""
    if isinstance(w, NVFP4Weight):
        return NVFP4Weight(w.packed[None], w.block_scale[None], jnp.reshape(w.global_scale, (1,)))
    return FP8Weight(w.data[None], jnp.reshape(w.scale, (1,)))


def nvfp4_matmul(x, packed, block_scale, global_scale, *, impl=None, tiling: Tiling = Tiling()):
    """y = x @ dequant(W)^T for an NVFP4 weight (W4A16), fp32 accumulation, y in x.dtype.

    x [..., K] bf16/f32; packed uint8 [N, K/2] (low nibble = even k); block_scale float8_e4m3fn
    [N, K/16]; global_scale float32 scalar. Returns [..., N]. K must be a multiple of 16.
    """
    impl = resolve_impl(impl)
    if impl == "xla":
        return reference.nvfp4_matmul(x, packed, block_scale, global_scale)
    return _run_blocked(x, NVFP4Weight(packed, block_scale, global_scale), impl, tiling)


def fp8_matmul(x, data, scale, *, impl=None, tiling: Tiling = Tiling()):
    """y = x @ (float(data) * scale)^T, W8A16: the FP8 weight is dequantised in-kernel, the
    activations are NOT quantised (they enter the MMA as float16, see _blocked); fp32 accumulation.

    x [..., K] bf16/f32; data float8_e4m3fn [N, K]; scale float32 scalar. Returns [..., N] in x.dtype.
    """
    impl = resolve_impl(impl)
    if impl == "xla":
        return reference.fp8_matmul(x, data, scale)
    return _run_blocked(x, FP8Weight(data, scale), impl, tiling)
