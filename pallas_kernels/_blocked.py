"""Blocked projection y[b] = x[b] @ W[eid[b]]^T through the Mosaic GPU kernel: operand prep and tiling.

x blocks [B, tm, K] (float), eid [B] int32 (negative: skip the block), W a stacked weight (dense
[E, N, K] or a format of pallas_kernels.formats) -> y float32 [B, R, N] (R = tm, or x's rows under
Tiling.store_real_rows; relu^2 products in their own dtype: blocked_linear).

bf16 activations (the model's) go to the kernel as they are and quantised weights decode to exact
bfloat16 values (Tiling.bf16_operands, on by default). Float32 activations, and bf16 ones with
bf16_operands off, go as float16 rescaled per row by a power of two (max |x| of each row becomes < 1,
or < 4 for rows beyond 2**126; undone on the f32 output) against weights decoded to exact float16 (the
cheapest exact decode: the e4m3 -> f16 pair conversion is one instruction): exact for bf16 values down
to 2**-14 of their row's max, below that f16 subnormals keep fewer bits (an absolute error under 2**-25
of the row max); f32 activations are rounded to 11 bits. So for bf16 activations the two paths give
the same products except for such small entries, which bfloat16 operands keep whole; the bfloat16 path
saves the rescale (two XLA launches a projection: the rows' max, the conversion) for a few more decode
instructions. Measured on an H100 at Nano dims (NVFP4, one process, interleaved calls): decode 2.1%
faster at batch 1 and 1.6% at batch 32, prefill of 8 x 512 tokens 2.6% (one 2,048-token prompt within
noise). Dense weights use their own dtype (bf16/f16). On the GPU, NVFP4 and FP8 weights against decode
blocks (up to 8 rows of bf16 activations) multiply with warp-level mma rather than wgmma (Tiling.mma_sync).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels._backend import interpret_params, num_sms
from pallas_kernels._wgemm import SMEM_TILE_ROWS, TN, X_TILE, mma_fits, weight_gemm
from pallas_kernels.formats import Weight, is_quantized, pow2, row_exponent

ROW_ALIGN = 32  # bytes: weight rows must hold whole 32-byte swizzle tiles
MMA_DTYPES = (jnp.bfloat16, jnp.float16)  # dense weights of these dtypes are streamed as they are


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Kernel tiling: tk streamed weight elements per K step (None: default_tk's choice), pipeline
    depth, whether A is staged in SMEM, CTAs per SM the split-K plan aims for (decode_ctas_per_sm for
    blocks of at most 8 rows, ctas_per_sm for larger ones), PTX weight decode, whether quantised
    weights decode to bfloat16 for bf16 activations (see the module docstring), the most rows of one
    MoE expert block (pallas_kernels.moe: prefill's blocks grow with the tokens per expert up to it),
    and the 64-row weight tiles a CTA multiplies with each activation tile it reads (weight_tiles for
    blocks of more than 8 rows, decode_weight_tiles for blocks of at most 8), only where the grid still
    fills the GPU with ctas_per_sm CTAs an SM (fewer CTAs would stream a GEMV's weights slower).

    Blocks of up to 8 rows aim for more CTAs: their split-K partial sums are small, and more, shorter
    CTAs run a GEMV's K loop faster (H100, NVFP4 M=1: 2688 -> 10304 10.6 µs with 7 splits against
    12.2 µs with 4; batch-1 decode ~4% faster at Nano dims). Larger blocks write tm rows of partial
    sums per split, which cost more than the shorter K loops save (batch 32: 1.5% slower at 8).

    Three weight tiles a CTA: a prefill block's CTAs each stream the block's whole [tm, K] activation
    rows for one 64-row weight tile, so with one tile the activations are most of the bytes a CTA
    reads (64 rows: 128 bytes per K element against the NVFP4 tile's 36). On an H100 at Nano dims
    (NVFP4, one process, interleaved calls) a 2,048-token prompt ran 17.9k -> 21.5k / 22.3k / 20.8k
    tok/s with 2 / 3 / 4 tiles, 8 x 512 tokens 16.0k -> 18.8k / 19.3k / 18.3k (4 tiles: 1 CTA an SM).
    Decode-size blocks gain nothing: batch-32 experts ran 5% slower with 2 tiles, 25% with 3.

    unpadded_rows: an op's activations that fill less than one block (a decode token's row, 1-7 rows of
    a batch) go to the kernel as they are, its TMA loads reading zeros past their last row, instead of as
    a zero-padded copy: at batch 1 an XLA launch fewer before each of ~105 weight kernels a step, same
    products (H100, NANO_NVFP4, gated, interleaved calls: batch 1 2.584 -> 2.547 ms, batch 32 unchanged).

    mma_sync: NVFP4 and FP8 weights at blocks of up to 8 rows multiply with warp-level mma (m16n8k16)
    instead of wgmma (_wgemm's mma), on the GPU only (the interpreter keeps wgmma). At M=1 the wgmma
    kernel moves ~2.9 G NVFP4 values a ms on an H100 whatever its decode costs (a third of the decode's
    work gave the same rate), 58% of the bytes the HBM could deliver; mma ~3.4 G. The kernel loads x in
    mma's K order itself (the format's load_mma_x) and stores its output as [tm, N] (_wgemm.ACC_SCALARS).
    Measured (H100, gated, interleaved calls): the M=1 NVFP4 GEMV 1.8 µs + bytes / 1,626 GB/s -> 1.7 µs
    + bytes / 1,858 GB/s; NANO_NVFP4 decode 2.577 -> 2.530 ms at batch 1 and 10.024 -> 9.811 ms at batch
    32; NANO_FP8 unchanged (x0.999 both, same tokens). With x permuted and the output transposed by XLA
    instead, the same kernels made decode 3.5% slower (83 launches against 78 in a four-layer step).

    lane_lowering: Mosaic GPU lowers the kernels at lane level, without its layout-inference pass (_wgemm's
    module docstring). The products are bit for bit the warpgroup-level lowering's on the GPU (H200, every
    format: decode rows through mma and wgmma, split-K, prefill blocks of three tiles, experts). Measured
    (NANO_NVFP4, batch 1, one process each): on an H200, decode program lower + compile 7.1 + 18.4 -> 5.1 +
    14.7 s, prefill 7.4 + 35.5 -> 3.2 + 30.3 s (Mosaic's own compile of the 11 decode kernels 4.1 -> 3.0
    s); on a 2-core CPU, lowering the decode program for the GPU 1.80 -> 1.02 s (batch 1) and 2.51 -> 1.32
    s (batch 32), the 2,048-token prefill program 9.2 -> 1.6 s.

    store_real_rows: where an op's activations fill less than its block (unpadded_rows: a decode token's
    row, 1-7 rows of a batch), the kernel stores only those rows of its float32 split-K partial sums, not
    all tm: at batch 1 an eighth of the bytes each weight kernel writes and the XLA reduction after it
    reads (otherwise ~15-23% of a Nano decode weight kernel's weight bytes: splits x 8 rows x N x 4).
    blocked_linear then returns those rows only; a one-token MoE's hidden activations are one row a block.
    Same products (GPU tests, every format). Measured (H100, NANO_NVFP4, gated, interleaved calls): batch 1
    2.623 -> 2.524 ms, batch 32 unchanged (x1.002, same tokens); the one-token experts' kernels 22.6 ->
    21.6 µs (NVFP4) and 28.2 -> 26.6 µs (FP8).

    mma_scale_pairs: under warp-level mma, NVFP4's block scales are loaded two rows (one 32-value chunk's two
    blocks) at a time in NVFP4Weight.mma_scale_layout, each thread holding only the scale of the block its
    weight codes belong to: half the scale loads and conversions to bfloat16 and no per-lane select, where
    every thread converted both blocks' scales and picked one. The NVFP4 weight kernels are
    instruction-bound on an H100 (schedulers issuing on ~70% of active cycles). Same products (GPU test).
    Measured (H100, Nsight Compute): the M=1 GEMV 2688 -> 10304 executes 5.38 -> 4.99 M instructions,
    10.98 -> 10.85 µs; GEMV fit 2.0 µs + bytes / 1,961 GB/s -> 2.1 + / 2,067; NANO_NVFP4 decode (gated,
    interleaved calls, two runs) batch 1 x0.986 and x0.987 (2.496 -> 2.461 ms), batch 32 x1.000, same
    tokens.

    stagger_x_loads: under warp-level mma, the activations' SMEM loads take Mosaic GPU's bank-conflict-free
    plan: two lane groups load a thread's registers in staggered order, and selects put them back (16 of
    the NVFP4 GEMV's 271 instructions a K step of 8 mma, Nsight Compute, run 23 in docs/BENCHMARKS.md).
    Off (the default), the loads are plain: no selects, two lanes of a wavefront sharing a bank on each
    8-byte load, which costs less in these instruction-bound kernels. Same products (GPU test). Measured
    (H100, NANO_NVFP4, gated, interleaved calls): batch 1 2.507 -> 2.483 ms (x0.992, rounds
    x0.990-x0.994), batch 32 x0.998, same tokens; NVFP4 GEMV fit 2.0 µs + bytes / 2,049 GB/s -> 1.9 +
    / 2,075.

    fused_relu2: an MoE's up projection stores relu(y)^2 in the activations' dtype from the kernel where
    it runs one split under wgmma (prefill blocks), instead of float32 products that an XLA fusion
    squares and converts: half the bytes the kernel writes and no pass over them (on the H200 that pass
    took 53 us a Nano MoE layer in a 2,048-token prefill). The same values bit for bit (CPU test against
    the XLA path; GPU kernel tests). Measured (H100, NANO_NVFP4, gated, interleaved calls, 8 rounds):
    prefill of one 2,048-token prompt x0.971 (rounds x0.960-x0.976), of 8 prompts of 512 x0.963, same
    tokens."""

    tk: int | None = None
    stages: int = 4
    stage_a: bool = False
    ctas_per_sm: int = 4
    decode_ctas_per_sm: int = 8
    ptx: bool = True
    bf16_operands: bool = True
    moe_block_rows: int = 64
    weight_tiles: int = 3
    decode_weight_tiles: int = 1
    unpadded_rows: bool = True
    mma_sync: bool = True
    lane_lowering: bool = True
    store_real_rows: bool = True
    mma_scale_pairs: bool = True
    stagger_x_loads: bool = False
    fused_relu2: bool = True


DEFAULT_TILING = Tiling()  # what ops called without a tiling use (benchmarks may rebind it to compare)


def trace_settings() -> tuple:
    """What ops read from this package's globals when traced: the innermost default_impl and the default
    tiling. A jit cache holding traced ops keys on it, so no trace made under other settings is reused."""
    return _backend.default_override(), DEFAULT_TILING


DECODE_BLOCK_ROWS = 8  # the smallest activation block (wgmma N): a decode batch of up to 8 tokens


def block_rows(m: int) -> int:
    """Activation rows per block (the wgmma N side): DECODE_BLOCK_ROWS for decode, up to 128 for prefill."""
    tm = DECODE_BLOCK_ROWS
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
    """(format or None, kernel weight [E, Np, Kw], block scales [E, K/16, Np] or None, f32 per-tensor scale
    [E]; the output scale is that over the format's operand_unit).

    Weights whose N is not a multiple of 64, or whose rows are not a multiple of 32 bytes, are zero-padded
    here: a copy of the packed weight, slow but correct; the Nemotron shapes never need it.
    """
    if is_quantized(w):
        fmt = type(w)
        arr, scale, post = w.stream()
    else:
        fmt, arr, scale = None, jnp.asarray(w), None
        post = jnp.ones(arr.shape[:1], jnp.float32)
    n_pad = -(-arr.shape[1] // TN) * TN
    arr = _pad_axis(arr, 1, n_pad)
    if scale is not None:
        scale = _pad_axis(scale, 2, n_pad)
    row_bytes = arr.shape[2] * arr.dtype.itemsize
    arr = _pad_axis(arr, 2, -(-row_bytes // ROW_ALIGN) * ROW_ALIGN // arr.dtype.itemsize)
    return fmt, arr, scale, post.astype(jnp.float32)


def _activations(xb, fmt, w_dtype, bf16_operands: bool):
    """The kernel's activation operand and per-row exponents to undo on the output (or None)."""
    if fmt is None:
        return xb.astype(w_dtype), None
    if bf16_operands and xb.dtype == jnp.bfloat16:
        return xb, None
    xf = xb.astype(jnp.float32)
    row_exp = row_exponent(jnp.max(jnp.abs(xf), axis=-1))
    return (xf * pow2(-row_exp)[..., None]).astype(jnp.float16), row_exp


def default_tk(w_dtype, k_per_element: int, tm: int, grid_fills_gpu: bool) -> int:
    """Streamed weight elements per K step where the tiling leaves tk None: 128 bytes of w_dtype; packed
    NVFP4 64 bytes, but 128 for decode-size blocks (tm <= 32) whose grid already fills the GPU, so that
    each CTA runs the whole K loop. Measured on an H100: NVFP4 experts at 32 decode tokens ran 17% faster
    with 128 bytes (batch-32 decode 8%); at 1 token (split-K) and in GEMVs no faster; a 2,048-token
    prefill 3% slower. A 128-byte NVFP4 step doubles the kernel's unrolled decode, which Mosaic lowers
    in ~0.6 s instead of ~0.3 s: hence only where it pays."""
    tk = 128 // jnp.dtype(w_dtype).itemsize
    return tk if k_per_element == 1 or (tm <= 32 and grid_fills_gpu) else tk // 2


def _plan(fmt, w_dtype, k: int, tm: int, n_tiles: int, num_blocks: int, tiling: Tiling):
    """(tk, splits, padded K, weight tiles per CTA) for one call: K steps of tk streamed elements, split
    so ~ctas_per_sm CTAs per SM (decode_ctas_per_sm for blocks of at most 8 rows) share the weight stream."""
    per = fmt.K_PER_ELEMENT if fmt else 1
    decode = tm <= DECODE_BLOCK_ROWS
    tiles = min(tiling.decode_weight_tiles if decode else tiling.weight_tiles, n_tiles)
    if -(-n_tiles // tiles) * num_blocks < tiling.ctas_per_sm * num_sms():
        tiles = 1
    n_tiles = -(-n_tiles // tiles)
    target = (tiling.decode_ctas_per_sm if decode else tiling.ctas_per_sm) * num_sms()
    tk = tiling.tk or default_tk(w_dtype, per, tm, n_tiles * num_blocks >= target)
    if fmt is None:  # swizzled W tiles: tk must divide K (K % 16 == 0 always allows 32 bytes)
        while k % tk:
            tk //= 2
    steps_total = -(-k // (tk * per))
    splits = max(1, min(steps_total, -(-target // (n_tiles * num_blocks))))
    steps = -(-steps_total // splits)
    splits = -(-steps_total // steps)
    return tk, splits, splits * steps * tk * per, tiles


def row_blocks(x, tm: int, tiling: Tiling | None = None):
    """x [M, K] -> [ceil(M / tm), tm, K], the last block zero-padded: the kernel's activation blocks;
    under tiling.unpadded_rows, M < tm rows stay one block [1, M', K] (blocked_linear's tm says the
    block's size): M' = M below SMEM_TILE_ROWS, else M padded to a multiple of it (a TMA copy's rows)."""
    m, k = x.shape
    if m < tm and (tiling or DEFAULT_TILING).unpadded_rows:
        return _pad_axis(x, 0, m if m < SMEM_TILE_ROWS else -(-m // SMEM_TILE_ROWS) * SMEM_TILE_ROWS)[None]
    blocks = -(-m // tm)
    return jnp.pad(x, ((0, blocks * tm - m), (0, 0))).reshape(blocks, tm, k)


def blocked_linear(xb, eid, w: Weight, impl: str, tiling: Tiling | None = None, tm: int | None = None,
                   relu2_dtype=None):
    """y[b] = xb[b] @ dequant(W[eid[b]])^T, float32 [B, R, N] for B = len(eid); xb [B, rows, K], or
    [1, rows, K] for rows every block reads; tm (default: xb's rows) may exceed xb's rows, which the
    kernel then extends with zero rows. R = tm, or xb's rows under tiling.store_real_rows (the rows past
    them are zeros). relu2_dtype: relu(y)^2 in that dtype instead (an MoE's hidden activations), from the
    kernel itself where tiling.fused_relu2 and the plan allow it. impl is "pallas" or "interpret"."""
    tiling = tiling or DEFAULT_TILING
    _, rows, k = xb.shape
    tm = tm or rows
    num_blocks = eid.shape[0]
    n = w.shape[-2]
    fmt, arr, scale, post = _weight_operands(w)
    tk, splits, k_total, tiles = _plan(fmt, arr.dtype, k, tm, arr.shape[1] // TN, num_blocks, tiling)
    x, row_exp = _activations(xb, fmt, arr.dtype, tiling.bf16_operands)
    if fmt is not None:
        post = post / fmt.operand_unit(x.dtype)
    mma = tiling.mma_sync and impl == "pallas" and mma_fits(fmt, x.dtype, tm, tiles, tk)
    scale_pairs = tiling.mma_scale_pairs and mma and hasattr(fmt, "mma_scale_layout")
    if k % X_TILE:  # else the TMA engine zero-fills the K tail: no padded copy of x
        x = _pad_axis(x, 2, k_total)
    fused = (relu2_dtype is not None and tiling.fused_relu2 and splits == 1 and not mma and row_exp is None
             and x.dtype == relu2_dtype)
    out = weight_gemm(x, arr, scale, eid, post if fused else None, fmt=fmt, tk=tk, splits=splits,
                      stages=tiling.stages, stage_a=tiling.stage_a, ptx=tiling.ptx, tiles=tiles, tm=tm, mma=mma,
                      scale_pairs=scale_pairs, stagger_x=tiling.stagger_x_loads or not mma, lane=tiling.lane_lowering,
                      out_rows=rows if tiling.store_real_rows else tm, relu2=fused,
                      interpret=interpret_params(impl))
    if impl == "interpret" and not isinstance(out, jax.core.Tracer):
        # The interpreter's callbacks dispatch jnp ops; an eager op queued behind them deadlocks.
        out = jax.block_until_ready(out)
    if fused:
        return out[0, :, :, :n]
    y = out.sum(axis=0)[:, :, :n] * post[eid][:, None, None]
    if row_exp is not None:
        y = y * pow2(_pad_axis(row_exp, 1, y.shape[1]))[..., None]  # rows past xb's: zeros
    return y if relu2_dtype is None else jnp.square(jnp.maximum(y, 0.0)).astype(relu2_dtype)
