"""Blocked projection y[b] = x[b] @ W[eid[b]]^T through the Mosaic GPU kernel: operand prep and tiling.

x blocks [B, tm, K] (float), eid [B] int32 (negative: skip the block), W a stacked weight
(dense [E, N, K], FP8Weight, NVFP4Weight) -> y float32 [B, tm, N].

Activations for quantised weights go to the kernel as float16 rescaled per row by a power of two
(max |x| of each row becomes < 1, undone on the f32 output): the conversion is exact for bf16 values
down to 2**-14 of their row's max (below that f16 subnormals keep fewer bits, an absolute error under
2**-25 of the row max), so activations are not quantised. f16 is the MMA type because the weights
decode to f16 (see _dequant); dense weights use their own dtype (bf16/f16; f32 runs as tf32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._backend import interpret_params
from pallas_kernels._wgemm import TN, weight_gemm_t
from nemoh.quant.types import FP8Weight, NVFP4Weight, Weight

NUM_SMS = 132  # H100 / H200 SXM
TARGET_CTAS = 4 * NUM_SMS  # split K until roughly this many CTAs share the weight stream
ROW_ALIGN = 32  # bytes: weight rows must hold whole 32-byte swizzle tiles


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Kernel tiling: tk activation columns per K step, pipeline depth, whether A is staged in SMEM."""

    tk: int | None = None
    stages: int = 2
    stage_a: bool = False
    target_ctas: int = TARGET_CTAS


def block_rows(m: int) -> int:
    """Activation rows per block (the wgmma N side): 8 for decode, up to 128 for prefill."""
    tm = 8
    while tm < min(m, 128):
        tm *= 2
    return tm


def _pad_axis(a, axis: int, size: int):
    extra = size - a.shape[axis]
    if extra <= 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def _weight_operands(w: Weight):
    """(fmt, kernel weight array [E, Np, Kw], block scales or None, per-expert f32 output scale [E]).

    Weights whose N is not a multiple of 64, or whose rows are not a multiple of 32 bytes (NVFP4 with
    K % 64 != 0, FP8 with K % 32 != 0), are zero-padded here: a copy of the packed weight, slow but
    correct; the Nemotron shapes never need it.
    """
    if isinstance(w, NVFP4Weight):
        fmt, arr, scale, post = "nvfp4", w.packed, w.block_scale, w.global_scale
    elif isinstance(w, FP8Weight):
        fmt, arr, scale, post = "fp8", w.data, None, w.scale
    else:
        fmt, arr, scale = "dense", jnp.asarray(w), None
        post = jnp.ones(arr.shape[:1], jnp.float32)
    n = arr.shape[1]
    n_pad = -(-n // TN) * TN
    arr = _pad_axis(arr, 1, n_pad)
    if scale is not None:
        scale = _pad_axis(scale, 1, n_pad)
    row_bytes = arr.shape[2] * arr.dtype.itemsize
    arr = _pad_axis(arr, 2, -(-row_bytes // ROW_ALIGN) * ROW_ALIGN // arr.dtype.itemsize)
    return fmt, arr, scale, post.astype(jnp.float32)


def _activations(xb, fmt: str, w_dtype, kx_total: int):
    """Kernel activation inputs (zero-padded to kx_total columns) and the per-row exponents (or None)."""
    if fmt == "dense":
        return (_pad_axis(xb.astype(w_dtype), 2, kx_total),), None
    xf = xb.astype(jnp.float32)
    _, row_exp = jnp.frexp(jnp.max(jnp.abs(xf), axis=-1))
    x16 = jnp.ldexp(xf, -row_exp[..., None]).astype(jnp.float16)
    parts = (x16[..., 0::2], x16[..., 1::2]) if fmt == "nvfp4" else (x16,)
    return tuple(_pad_axis(p, 2, kx_total) for p in parts), row_exp


def _plan(fmt: str, w_dtype, kx: int, n_tiles: int, num_blocks: int, tiling: Tiling):
    """(tk, splits, K extent) for one call: K steps of tk columns, split so ~target_ctas CTAs run."""
    tk = tiling.tk or (64 if fmt == "nvfp4" else 128 // jnp.dtype(w_dtype).itemsize)
    if fmt == "dense":  # swizzled W tiles: tk must divide K (K % 16 == 0 always allows 32 bytes)
        while kx % tk:
            tk //= 2
    steps_total = -(-kx // tk)
    splits = max(1, min(steps_total, -(-tiling.target_ctas // (n_tiles * num_blocks))))
    steps = -(-steps_total // splits)
    splits = -(-steps_total // steps)
    return tk, splits, splits * steps * tk


def blocked_linear(xb, eid, w: Weight, impl: str, tiling: Tiling = Tiling()):
    """y[b] = xb[b] @ dequant(W[eid[b]])^T, float32 [B, tm, N]; impl is "pallas" or "interpret"."""
    num_blocks, _, k = xb.shape
    n = w.shape[-2]
    fmt, arr, scale, post = _weight_operands(w)
    kx = k // 2 if fmt == "nvfp4" else k
    tk, splits, kx_total = _plan(fmt, arr.dtype, kx, arr.shape[1] // TN, num_blocks, tiling)
    xs, row_exp = _activations(xb, fmt, arr.dtype, kx_total)
    out = weight_gemm_t(xs, arr, scale, eid, fmt=fmt, tk=tk, splits=splits, stages=tiling.stages,
                        stage_a=tiling.stage_a, interpret=interpret_params(impl))
    if impl == "interpret" and not isinstance(out, jax.core.Tracer):
        # The interpreter's callbacks dispatch jnp ops; an eager op queued behind them deadlocks.
        out = jax.block_until_ready(out)
    y = jnp.swapaxes(out.sum(axis=0), 1, 2)[:, :, :n] * post[eid][:, None, None]
    return y if row_exp is None else jnp.ldexp(y, row_exp[..., None])
