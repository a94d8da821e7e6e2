"""The one Mosaic GPU kernel behind every op: a weight-stationary, swap-AB blocked GEMM.

For each block b of `tm` activation rows and each 64-row tile of its weight W[eid[b]] (logical
[N, K]) it computes the transposed product  out[s, b, n, :] = W[eid[b], n, Ks] @ x[b, :, Ks]^T  over
the K range Ks of split s (split-K; the caller sums over s). Weights sit on the wgmma M side (64 rows,
the Hopper minimum), activations on the N side (tm = 8..128), so decode (M = 1..8) wastes no weight
bandwidth. Quantised weights are decoded in registers right before the wgmma (never written back).

Weight formats (`fmt`):
  "nvfp4": xs = (x_even, x_odd) float16 [B, tm, K/2]; w = packed uint8 [E, N, K/2];
           scale = block scales float8_e4m3fn [E, N, K/16]; out = sum_k e2m1 * block_scale * x.
  "fp8":   xs = (x,) float16 [B, tm, K]; w = float8_e4m3fn [E, N, K]; out = sum_k w * x.
  "dense": xs = (x,) in w.dtype [B, tm, K]; w = bf16/f16/f32 [E, N, K] (f32 runs as tf32).
Per-tensor scales (NVFP4 global scale, FP8 scale) are applied by the caller on the f32 output.

Shape contract (the callers pad): N % 64 == 0; xs' K extent == splits * steps * tk (zero padded);
w's K extent may be shorter than xs' (the TMA engine zero-fills the tail) but must be a multiple of
32 bytes (dense w: of tk).
Blocks with eid[b] < 0 are skipped and their output left unwritten.

stage_a: decoded A operands go registers -> SMEM -> wgmma instead of straight from registers. The
interpreter only models SMEM operands, so interpret mode always stages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._dequant import e2m1_pair_to_f16, fp8_to_f16, scale_column_chunks

TN = 64  # weight rows per CTA (wgmma M)
NVFP4_BYTES_PER_GROUP = 8  # 16 e2m1 codes share one block scale

# One value per row of a 64-row WGMMA tile (what a row reduction of a WGMMA-layout array yields).
_ROW = plgpu.Layout.TILED(
    plgpu.Tiling(((64,), (16,), (8,), (1,))),
    warp_dims=(-4,),
    lane_dims=(-2, plgpu.Replicated(4)),
    vector_dim=-1,
)


def _smem_transforms(dtype, minor: int):
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _weight_transforms(fmt, w, tk: int):
    """SMEM tiling of a weight tile. Dense W is a wgmma operand and shares x's swizzle; a quantised
    tile only goes to registers, so it takes the widest swizzle whose width divides w's K extent
    (Mosaic's TMA tiles the GMEM side too), letting the last K step run past K (zero fill)."""
    if fmt == "dense":
        return _smem_transforms(w.dtype, tk)
    for swizzle in (128, 64, 32):
        if tk % swizzle == 0 and w.shape[-1] % swizzle == 0:
            return plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle)
    raise ValueError(f"weight K extent {w.shape[-1]} bytes must be a multiple of 32")


def _step_operands(fmt, w_smem, s_ref, e, n0, kg, tk):
    """The wgmma A operands (one per x input) for global K step `kg` of this weight tile.

    NVFP4 block scales are read column by column straight from GMEM into a per-row layout: their rows
    (K/16 bytes) are not 16-byte aligned for TMA. Those loads and the integer e2m1 decode are what
    bound the NVFP4 kernel (~1 TB/s at decode on H200, against ~2.9 TB/s for FP8)."""
    if fmt == "dense":
        return [w_smem]
    codes = plgpu.load(w_smem, layout=plgpu.Layout.WGMMA)
    if fmt == "fp8":
        return [fp8_to_f16(codes)]
    groups = tk // NVFP4_BYTES_PER_GROUP
    last = s_ref.shape[-1] - 1
    scales = [
        fp8_to_f16(plgpu.load(s_ref.at[e, pl.ds(n0, TN), jnp.minimum(kg * groups + c, last)],
                              layout=_ROW, optimized=False))
        for c in range(groups)
    ]
    lo, hi = e2m1_pair_to_f16(codes)
    return [scale_column_chunks(v, scales, NVFP4_BYTES_PER_GROUP) for v in (lo, hi)]


@functools.partial(jax.jit, static_argnames=("fmt", "tk", "splits", "stages", "stage_a", "interpret"))
def weight_gemm_t(xs, w, scale, eid, *, fmt: str, tk: int, splits: int, stages: int, stage_a: bool = False,
                  interpret=None):
    """Transposed blocked product, float32 [splits, B, N, tm] (see module docstring)."""
    xs = tuple(xs)
    num_blocks, tm, kx = xs[0].shape
    _, n, _ = w.shape
    steps = kx // (tk * splits)
    if n % TN or kx != steps * tk * splits or steps < 1:
        raise ValueError(f"bad blocking: N={n}, K extent {kx}, tk={tk}, splits={splits}")
    stage_a = (stage_a or interpret is not None) and fmt != "dense"
    a_transforms = _smem_transforms(jnp.float16, tk)
    w_transforms = _weight_transforms(fmt, w, tk)

    def wgemm(eid_ref, *refs):
        x_refs, w_ref = refs[:len(xs)], refs[len(xs)]
        s_ref = refs[len(xs) + 1] if fmt == "nvfp4" else None
        o_ref, a_smem = refs[-2:]
        ni, b, s = lax.axis_index("n"), lax.axis_index("b"), lax.axis_index("s")
        e = eid_ref[b]
        n0 = ni * TN

        @pl.when(e >= 0)
        def _():
            def acc_scope(acc):
                def step(idx, *smem):
                    kg = s * steps + idx[0]
                    a_ops = _step_operands(fmt, smem[-1], s_ref, e, n0, kg, tk)
                    if stage_a:
                        for i, a in enumerate(a_ops):
                            a_smem[i] = a
                        plgpu.commit_smem()
                        a_ops = [a_smem.at[i] for i in range(len(a_ops))]
                    for a, x_smem in zip(a_ops, smem[:-1]):
                        plgpu.wgmma(acc, a, x_smem.T)
                    plgpu.wgmma_wait(0)

                x_spec = plgpu.BlockSpec((tm, tk), lambda k: (0, s * steps + k),
                                         transforms=_smem_transforms(xs[0].dtype, tk))
                w_spec = plgpu.BlockSpec((TN, tk), lambda k: (ni, s * steps + k), transforms=w_transforms)
                plgpu.emit_pipeline(
                    step, grid=(steps,), in_specs=[x_spec] * len(xs) + [w_spec],
                    max_concurrent_steps=stages,
                )(*[x.at[b] for x in x_refs], w_ref.at[e])
                return acc[...]

            o_ref[s, b, pl.ds(n0, TN), :] = pl.run_scoped(acc_scope, plgpu.ACC((TN, tm)))

    kernel = plgpu.kernel(
        wgemm,
        out_type=jax.ShapeDtypeStruct((splits, num_blocks, n, tm), jnp.float32),
        grid=(n // TN, num_blocks, splits),
        grid_names=("n", "b", "s"),
        scratch_types=[plgpu.SMEM((len(xs) if stage_a else 1, TN, tk), jnp.float16,
                                  transforms=a_transforms)],
        interpret=interpret,
    )
    operands = (eid, *xs, w) + ((scale,) if fmt == "nvfp4" else ())
    return kernel(*operands)
