"""The one Mosaic GPU kernel behind every op: a weight-stationary, swap-AB blocked GEMM.

For each block b of `tm` activation rows and each 64-row tile of its weight W[eid[b]] (logical
[N, K]) it computes  out[s, b, :, n] = x[b, :, Ks] @ W[eid[b], n, Ks]^T  over the K range Ks of split s
(split-K; the caller sums over s). Weights sit on the wgmma M side (64 rows, the Hopper minimum),
activations on the N side (tm = 8..128), so decode (M = 1..8) wastes no weight bandwidth; the [64, tm]
accumulator is stored transposed, so the output is row-major [tm, N] per block as its consumers read it
(no transpose pass in XLA), or only its first rows where the activations hold fewer (out_rows). A CTA
may take `tiles` adjacent weight tiles, each with its own accumulator, against each activation tile it
streams (a block's activations are read once per CTA).
Quantised weights are decoded in registers right before the wgmma (never written back).

Operands (`fmt` is None for a dense weight, else a format class of pallas_kernels.formats, or another
class with its interface):
  x      [B, tm, K] (or fewer rows, read as zeros past them) in the MMA dtype (dense: the weight's
         dtype; quantised: float16 or bfloat16, which the weight decodes to)
  w      [E, N, Kw] streamed weight elements (Kw = K / fmt.K_PER_ELEMENT)
  scale  [E, K/16, N] block scales streamed with the codes (formats with ELEMENTS_PER_SCALE_ROW), or None
Each K step streams a (64 * tiles, tk) weight tile, its (tk / ELEMENTS_PER_SCALE_ROW, 64 * tiles) scale
tile and a (tm, tk * K_PER_ELEMENT) activation tile through one TMA pipeline. Per-tensor scales are
applied by the caller on the f32 output, or by the kernel where it stores an MoE's hidden activations
(relu2).

Shape contract (the callers pad): N % 64 == 0; x's K extent is at most splits * steps * tk *
K_PER_ELEMENT and a multiple of X_TILE elements, or exactly that; w's K extent may be shorter too but
must be a multiple of 32 bytes (dense w: of tk). The TMA engine zero-fills the tails past K (and so
scale tiles past the last block read as zero).
Blocks with eid[b] < 0 are skipped and their output left unwritten.

stage_a: decoded A operands go registers -> SMEM -> wgmma instead of straight from registers. The
interpreter only models SMEM operands, so interpret mode always stages. ptx: the format's hand-written
PTX decode (GPU only; interpret mode runs the same decode in jnp). mma: blocks of 8 rows multiply with
warp-level mma (m16n8k16, each warp 16 weight rows, its accumulator in registers across K steps) instead
of wgmma, the weight decoded straight into mma's A layout (the format's `decode_mma_tile`, K in its
`mma_k_order`; x loaded in the same order by its `load_mma_x`), the accumulator stored to the [tm, N]
output value by value (ACC_SCALARS). GPU only (the interpreter runs neither mma nor PTX).

Lowering: by default Mosaic GPU lowers a kernel at warpgroup level, a layout-inference pass giving every
register array its layout before each op is lowered to lanes. These kernels give their arrays' layouts
explicitly (the loads', layout_cast, the accumulators'), so they also lower at lane level (`lane`), each op
taking its operands' layouts as they are, without that pass: the same products bit for bit, in less
compile time (pallas_kernels._blocked.Tiling.lane_lowering); the index arithmetic and shuffles differ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

TN = 64  # weight rows per tile (wgmma M); a CTA takes `tiles` adjacent tiles
X_TILE = 64  # activation elements per row of an x SMEM tile (the widest swizzle tile of 2-byte x)

# One value per row of a 64-row WGMMA tile (what a row reduction of a WGMMA-layout array yields).
ROW_LAYOUT = plgpu.Layout.TILED(
    plgpu.Tiling(((64,), (16,), (8,), (1,))),
    warp_dims=(-4,),
    lane_dims=(-2, plgpu.Replicated(4)),
    vector_dim=-1,
)


SMEM_TILE_ROWS = 8  # rows of an SMEM tile: a TMA copy's row extent must be below it or a multiple of it


def _smem_transforms(dtype, minor: int):
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((SMEM_TILE_ROWS, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _weight_transforms(fmt, w, tk: int):
    """SMEM tiling of a weight tile. Dense W is a wgmma operand and shares x's swizzle; a quantised
    tile only goes to registers, so it takes the widest swizzle whose width divides w's K extent
    (Mosaic's TMA tiles the GMEM side too), letting the last K step run past K (zero fill)."""
    if fmt is None:
        return _smem_transforms(w.dtype, tk)
    size = jnp.dtype(w.dtype).itemsize
    for swizzle in (128, 64, 32):
        if (tk * size) % swizzle == 0 and (w.shape[-1] * size) % swizzle == 0:
            return plgpu.TilingTransform((SMEM_TILE_ROWS, swizzle // size)), plgpu.SwizzleTransform(swizzle)
    raise ValueError(f"weight K extent {w.shape[-1] * size} bytes must be a multiple of 32")


def scale_rows_per_step(fmt, tk: int) -> int:
    """Block-scale rows one K step of tk streamed weight elements needs (0: the format has none)."""
    per_row = getattr(fmt, "ELEMENTS_PER_SCALE_ROW", None)
    return tk // per_row if per_row else 0


# warp-level mma's float32 accumulator (MMA_ACC) with each register's two values as registers of their own,
# so a thread's values can be stored one by one into a transposed ([tm, N]) output
ACC_SCALARS = plgpu.Layout.TILED(plgpu.Tiling(((64, 8), (16, 8), (8, 8), (2,), (1,))), warp_dims=(-8,),
                                 lane_dims=(-4, -3), vector_dim=-1)


def acc_scalar_register(index: tuple[int, ...], e: int) -> tuple[int, ...]:
    """Where value e of MMA_ACC register `index` goes among ACC_SCALARS' registers (the same thread)."""
    return index[:-1] + (e, 0)


def relabel_registers(x, in_layout, out_layout, width: int, where):
    """x, a register array in in_layout -> the same values in out_layout, none moved between threads:
    each register's vector split into pieces of `width` values, piece j of the register at index i of
    in_layout's registers becoming out_layout's register where(i, j). GPU only (inline Mosaic GPU)."""
    out_ty = plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=out_layout)

    @plgpu.inline_mgpu(arg_types=(in_layout,), return_type=out_ty)
    def relabel(_, v):
        layout, given = out_layout.to_mgpu(), in_layout.to_mgpu()
        if v.registers.shape != given.registers_shape(x.shape):  # where() indexes in_layout's registers
            raise ValueError(f"registers {v.registers.shape} are not {given}'s for shape {x.shape}")
        out = np.empty(layout.registers_shape(x.shape), dtype=object)
        for index, vector in np.ndenumerate(v.registers):
            for j in range(given.vector_length // width):
                out[where(index, j)] = mgpu.utils.vector_slice(vector, slice(j * width, (j + 1) * width))
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)

    return relabel(x)


def mma_fits(fmt, x_dtype, tm: int, tiles: int, tk: int) -> bool:
    """Whether weight_gemm's warp-level mma path takes these operands: a format with decode_mma_tile,
    bfloat16 x, 8-row blocks, one weight tile a CTA, and K steps of whole 32-byte code tiles (whole
    mma_k_order chunks of weight and x: a K tail past the data reads zeros in both)."""
    return hasattr(fmt, "decode_mma_tile") and x_dtype == jnp.bfloat16 and tm == 8 and tiles == 1 and tk % 32 == 0


@functools.partial(jax.jit, static_argnames=("fmt", "tk", "splits", "stages", "stage_a", "ptx", "tiles", "tm",
                                             "mma", "scale_pairs", "stagger_x", "lane", "out_rows", "relu2",
                                             "interpret"))
def weight_gemm(x, w, scale, eid, post=None, *, fmt, tk: int, splits: int, stages: int, stage_a: bool = False,
                ptx: bool = False, tiles: int = 1, tm: int | None = None, mma: bool = False, scale_pairs: bool = False,
                stagger_x: bool = True, lane: bool = False, out_rows: int | None = None, relu2: bool = False,
                interpret=None):
    """Blocked product, float32 [splits, B, out_rows, N] (see module docstring); B = len(eid), and x
    [1, rows, K] is every block's rows (one token's experts all read the same row). tm: rows of a block
    (default: x's); x may hold fewer, whose TMA loads read zeros past its last row (no padded copy of a
    decode token's row). out_rows: the rows of each block's product stored (default tm), at least x's
    rows: fewer than tm stores only those (a decode token's one row of partial sums, not tm), through an
    SMEM tile and a TMA copy of its first out_rows rows. tiles: 64-row weight tiles one CTA multiplies
    with each activation tile it streams (the activation traffic divided by tiles; a last CTA's tiles past
    N read zeros and store nothing). mma: warp-level mma for 8-row blocks (module docstring); scale_pairs:
    under mma, the block scales loaded two rows at a time in the format's mma_scale_layout, each thread
    holding only the block its lanes' weight codes belong to (else every row whole, in ROW_LAYOUT);
    stagger_x: under mma, x's SMEM loads take Mosaic's bank-conflict-free plan (lanes in two groups loading
    in staggered order, their registers put back with selects), else the plain one. lane: Mosaic
    GPU lowers the kernel at lane level (LoweringSemantics.Lane) instead of warpgroup level, skipping its
    layout inference (module docstring). relu2: the stored product is relu(acc * post[eid[b]])^2 in x's
    dtype (post: float32 [E], the weight's per-tensor scale), an MoE's hidden activations as the down
    projection reads them, instead of float32 partial sums; one split, wgmma only."""
    (num_blocks,), (x_blocks, rows, kx) = eid.shape, x.shape
    tm = tm or rows
    out_rows = out_rows or tm
    if x_blocks not in (1, num_blocks):
        raise ValueError(f"x has {x_blocks} blocks for {num_blocks} expert ids: must be 1 or {num_blocks}")
    if rows > tm:
        raise ValueError(f"x blocks of {rows} rows for a kernel block of tm={tm} rows")
    if not rows <= out_rows <= tm or (out_rows < tm and out_rows > SMEM_TILE_ROWS and out_rows % SMEM_TILE_ROWS):
        raise ValueError(f"out_rows={out_rows} for x blocks of {rows} rows and tm={tm}: must lie between them, "
                         f"below {SMEM_TILE_ROWS} or a multiple of it (a TMA copy's rows)")
    _, n, _ = w.shape
    tkx = tk * (fmt.K_PER_ELEMENT if fmt else 1)
    steps = -(-kx // (tkx * splits))
    if n % TN or steps < 1 or tiles < 1 or (kx != steps * tkx * splits and kx % X_TILE):
        raise ValueError(f"bad blocking: N={n}, K extent {kx}, tk={tk}, splits={splits}, tiles={tiles}")
    tn = TN * tiles  # weight rows a CTA streams
    n_scale = scale_rows_per_step(fmt, tk)
    if (scale is None) != (n_scale == 0):
        raise ValueError(f"format {fmt} streams {n_scale} scale rows a step, got scale={scale is not None}")
    stage_a = (stage_a or interpret is not None) and fmt is not None
    ptx = ptx and interpret is None
    mma_dtype = x.dtype
    if fmt is not None and mma_dtype not in (jnp.float16, jnp.bfloat16):
        raise ValueError(f"quantised weights decode to float16 or bfloat16 (x's dtype), got x in {mma_dtype}")
    if scale_pairs and not (mma and n_scale and hasattr(fmt, "mma_scale_layout")):
        raise ValueError(f"scale_pairs: block scales loaded for warp-level mma by the format's mma_scale_layout; "
                         f"got {fmt}, mma={mma}")
    if relu2 and (splits != 1 or mma or post is None):
        raise ValueError(f"relu2 stores whole products scaled by post under wgmma: got splits={splits}, mma={mma}, "
                         f"post={'given' if post is not None else None}")
    if mma and (interpret is not None or not mma_fits(fmt, mma_dtype, tm, tiles, tk)):
        raise ValueError(f"warp-level mma takes what mma_fits accepts, on the GPU: got {fmt}, {mma_dtype}, tm={tm}, "
                         f"tiles={tiles}, tk={tk}, interpret={interpret is not None}")

    out_dtype = mma_dtype if relu2 else jnp.float32

    def wgemm(eid_ref, x_ref, w_ref, *refs):
        s_ref, refs = (refs[0], refs[1:]) if n_scale else (None, refs)
        post_ref, refs = (refs[0], refs[1:]) if relu2 else (None, refs)
        o_ref, *scratch = refs
        a_smem = scratch.pop(0) if stage_a else None
        o_smem = scratch.pop(0) if out_rows < tm else None

        def store_out(acc, n0):
            """acc [64, tm] (a layout whose transposed store Mosaic takes) -> out[s, b, :, n0:n0+64]^T."""
            if relu2:
                acc = jnp.maximum(acc * post_ref[e], 0.0)
                acc = (acc * acc).astype(out_dtype)
            if o_smem is None:
                o_ref.at[s, b, :, pl.ds(n0, TN)].T[...] = acc
                return
            o_smem.T[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[:out_rows], o_ref.at[s, b, :, pl.ds(n0, TN)])
            plgpu.wait_smem_to_gmem(0)

        ni, b, s = lax.axis_index("n"), lax.axis_index("b"), lax.axis_index("s")
        e = eid_ref[b]

        @pl.when(e >= 0)
        def _():
            k0 = s * steps
            specs = [plgpu.BlockSpec((tm, tkx), lambda k: (0, k0 + k), transforms=_smem_transforms(mma_dtype, tkx)),
                     plgpu.BlockSpec((tn, tk), lambda k: (ni, k0 + k), transforms=_weight_transforms(fmt, w, tk))]
            operands = [x_ref.at[b if x_blocks > 1 else 0], w_ref.at[e]]
            if n_scale:
                specs.append(plgpu.BlockSpec((n_scale, tn), lambda k: (k0 + k, ni)))
                operands.append(s_ref.at[e])
            pipeline = lambda step, **carry: plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs,
                                                                  max_concurrent_steps=stages, **carry)(*operands)
            if mma:
                def mma_step(_, x_smem, w_smem, *s_smem_acc):
                    *s_smem, acc = s_smem_acc
                    codes = plgpu.load(w_smem, layout=plgpu.Layout.MMA_LHS(jnp.uint8))
                    if scale_pairs:  # each thread only its lanes' block of each two (the format's layout)
                        scales = [plgpu.load(s_smem[0].at[pl.ds(2 * c, 2)], layout=fmt.mma_scale_layout(),
                                             optimized=False) for c in range(n_scale // 2)]
                    else:
                        scales = [plgpu.load(s_smem[0].at[c], layout=ROW_LAYOUT, optimized=False) for c in range(n_scale)]
                    x_operand = fmt.load_mma_x(x_smem.T, optimized=stagger_x)
                    return plgpu.mma(acc, fmt.decode_mma_tile(codes, scales), x_operand)

                zero = plgpu.layout_cast(jnp.zeros((TN, tm), jnp.float32), plgpu.Layout.MMA_ACC(mma_dtype))
                acc = relabel_registers(pipeline(mma_step, init_carry=zero), plgpu.Layout.MMA_ACC(mma_dtype),
                                        ACC_SCALARS, 1, acc_scalar_register)  # a register's pair split
                store_out(acc, ni * TN)
                return

            def acc_scope(*accs):
                def step(_, x_smem, w_smem, *s_smem):
                    for j, acc in enumerate(accs):  # tile j's decode overlaps tile j-1's wgmma
                        w_tile = w_smem.at[pl.ds(j * TN, TN)] if tiles > 1 else w_smem
                        if fmt is None:
                            a = w_tile
                        else:
                            codes = plgpu.load(w_tile, layout=plgpu.Layout.WGMMA)
                            rows = [plgpu.load(s_smem[0].at[c, pl.ds(j * TN, TN)], layout=ROW_LAYOUT, optimized=False)
                                    for c in range(n_scale)]
                            a = fmt.decode_tile(codes, rows, ptx, mma_dtype)
                            if stage_a:  # one staging buffer: the previous tile's wgmma must be done with it
                                plgpu.wgmma_wait(0)
                                a_smem[...] = a
                                plgpu.commit_smem()
                                a = a_smem
                        plgpu.wgmma(acc, a, x_smem.T)
                    plgpu.wgmma_wait(0)

                pipeline(step)
                return tuple(acc[...] for acc in accs)

            accs = pl.run_scoped(acc_scope, *[plgpu.ACC((TN, tm))] * tiles)
            for j, acc in enumerate(accs):
                n0 = (ni * tiles + j) * TN

                def store(n0=n0, acc=acc):  # WGMMA_TRANSPOSED pairs registers along the weight rows (one shuffle
                    # away from WGMMA), so each thread stores adjacent n of the row-major output tile
                    store_out(plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED), n0)

                if n % tn:  # the last CTA's tiles may lie past N
                    pl.when(n0 < n)(store)
                else:
                    store()

    kernel = plgpu.kernel(
        wgemm,
        out_type=jax.ShapeDtypeStruct((splits, num_blocks, out_rows, n), out_dtype),
        grid=(-(-n // tn), num_blocks, splits),
        grid_names=("n", "b", "s"),
        scratch_types=([plgpu.SMEM((TN, tkx), mma_dtype, transforms=_smem_transforms(mma_dtype, tkx))] if stage_a else [])
        + ([plgpu.SMEM((tm, TN), out_dtype)] if out_rows < tm else []),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane) if lane else None,
    )
    return kernel(eid, x, w, *((scale,) if n_scale else ()), *((post,) if relu2 else ()))
