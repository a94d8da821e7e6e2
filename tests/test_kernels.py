"""pallas_kernels: each kernel (impl="interpret" on CPU; PALLAS_KERNELS_IMPL=pallas on a GPU) against its
"xla" reference and against float64 numpy built from pallas_kernels.dequantize.

Unwritten outputs cannot pass: the interpreter fills every allocated buffer with NaN
(uninitialized_memory="nan"), so a kernel output tile that is never written surfaces as NaN, and every
check first asserts there is none (on the GPU the same assertion catches garbage).

Tolerances (norm-relative ||y - ref|| / ||ref||, and max |y - ref| / max |ref|):
  * float64: weight decode is exact (e2m1 x e4m3 and e4m3 fit float16), products are exact in the
    fp32 accumulator, so the error is the activations' float16 rounding (exact for bf16 inputs, 2**-12
    rms for f32 inputs) plus the output's rounding: 2**-9 for bf16 outputs. Bounds: 1e-3 (f32 out), 5e-3 (bf16 out); 8e-3 for bf16 MoE, whose hidden
    activation is also rounded to bf16 between the projections.
  * vs "xla": that path rounds the dequantised weight to x.dtype first (2**-9 more for bf16): 1e-2.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_equations import equations

from pallas_kernels import FP8Weight, NVFP4Weight, dequantize, linear, moe_experts
from pallas_kernels.formats import (DECODE_PTX, E2M1_UNIT, E2M1_VALUES, NVFP4_BLOCK, e2m1_pair_to_f16, mma_operand_register,
                                    mma_rhs_register, pow2, row_exponent)
from pallas_kernels._backend import num_sms
from pallas_kernels import _blocked, _wgemm
from pallas_kernels._blocked import Tiling, _plan
from pallas_kernels import moe as moe_ops
from pallas_kernels.moe import route_blocks

IMPL = os.environ.get("PALLAS_KERNELS_IMPL", "interpret")


def gpu_only(reason: str):
    """A test of what only the GPU runs: skipped in interpret mode (the only skip tests/conftest.py allows)."""
    return lambda test: pytest.mark.gpu_only(pytest.mark.skipif(IMPL != "pallas", reason=reason)(test))


TOL_F64 = {jnp.float32: 1e-3, jnp.bfloat16: 5e-3}
TOL_XLA = 1e-2


def _rng(seed):
    return np.random.default_rng(seed)


def _x(rng, shape, dtype):
    return jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(dtype)


def _nvfp4(rng, lead, n, k):
    packed = rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8)
    block = rng.uniform(0.05, 4.0, (*lead, n, k // 16)).astype(np.float32)
    glob = rng.uniform(0.002, 0.02, lead).astype(np.float32)
    return NVFP4Weight.from_hf(packed, jnp.asarray(block).astype(jnp.float8_e4m3fn), glob)


def _fp8(rng, lead, n, k):
    data = np.clip(rng.normal(0.0, 80.0, (*lead, n, k)), -448, 448).astype(np.float32)
    scale = rng.uniform(0.002, 0.02, lead).astype(np.float32)
    return FP8Weight.from_hf(jnp.asarray(data).astype(jnp.float8_e4m3fn), scale)


def _dense(rng, lead, n, k):
    return jnp.asarray(rng.normal(0.0, 0.2, (*lead, n, k)).astype(np.float32)).astype(jnp.bfloat16)


WEIGHTS = {"dense": _dense, "fp8": _fp8, "nvfp4": _nvfp4}


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _same_bits(got, want, what):
    """The two outputs are equal bit for bit (compared as float32, which holds bf16 and f16 exactly)."""
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=what)


def _routes(rng, tokens):
    """Each of `tokens` tokens' two distinct experts of 4 (int32 [tokens, 2]) and their weights (float32)."""
    idx = jnp.asarray(np.stack([rng.choice(4, 2, replace=False) for _ in range(tokens)]).astype(np.int32))
    return idx, jnp.asarray(rng.uniform(0.1, 1.0, (tokens, 2)), jnp.float32)


def _check(y, ref, tol, what):
    y, ref = _f64(y), np.asarray(ref, np.float64)
    assert y.shape == ref.shape, (what, y.shape, ref.shape)
    assert np.isfinite(y).all(), f"{what}: non-finite output (unwritten tile or NaN leak)"
    norm_err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    max_err = np.abs(y - ref).max() / np.abs(ref).max()
    assert norm_err < tol and max_err < 2 * tol, (what, norm_err, max_err, tol)


def test_decode_helpers_exact():
    codes = np.arange(256, dtype=np.uint8)
    lo, hi = e2m1_pair_to_f16(jnp.asarray(codes))
    np.testing.assert_array_equal(np.asarray(lo, np.float32), E2M1_VALUES[codes & 15] * E2M1_UNIT)
    np.testing.assert_array_equal(np.asarray(hi, np.float32), E2M1_VALUES[codes >> 4] * E2M1_UNIT)
    f8 = jnp.asarray(codes).view(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(f8.astype(jnp.float16), np.float32), np.asarray(f8, np.float32))
    # every decoded e2m1 (times E2M1_UNIT) times every e4m3 block scale is exact in float16, subnormal
    # products (down to 2**-16) included: the kernel's operand, E2M1_UNIT undone on its f32 output
    got = np.asarray(lo[:16, None] * f8.astype(jnp.float16)[None, :], np.float32)
    want = E2M1_VALUES[:16, None] * E2M1_UNIT * np.asarray(f8, np.float32)[None, :]
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite], want[finite])


def _run_ptx(lines: list[str], word: int) -> tuple[int, int]:
    """The decode programs' PTX executed on the CPU, instruction by instruction (the few they use: b32 mov,
    shl, shr, and, or, prmt, mul.lo.u32; the b16 split; cvt.rn.f16x2.e4m3x2), $1 = word: (%nv_r0, %nv_r1)."""
    reg = {"$1": word}
    value = lambda t: reg[t] if t in reg else int(t, 0)
    for line in lines:
        op, args = line.rstrip(";").split(None, 1)
        if args.startswith("{"):  # mov.b32 {lo16, hi16}, a
            halves, src = args.split("}, ")
            low, high = halves.strip("{").split(", ")
            reg[low], reg[high] = value(src) & 0xFFFF, value(src) >> 16
            continue
        dst, *srcs = [a.strip() for a in args.split(",")]
        v = [value(x) for x in srcs]
        if op == "prmt.b32":  # default mode: selector nibble i picks byte (0-7) of {b, a} for byte i
            pool = v[0] | v[1] << 32
            assert all((v[2] >> 4 * i) & 8 == 0 for i in range(4)), "sign-replicating selectors are not modelled"
            out = sum(((pool >> 8 * ((v[2] >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "cvt.rn.f16x2.e4m3x2":  # byte i of the b16 source -> half i of the result
            f8 = np.array([v[0] & 0xFF, v[0] >> 8], np.uint8).view(jnp.float8_e4m3fn)
            halves = np.asarray(f8.astype(np.float16)).view(np.uint16)
            out = int(halves[0]) | int(halves[1]) << 16
        else:
            out = {"mov.b32": lambda: v[0], "shl.b32": lambda: v[0] << v[1], "shr.b32": lambda: v[0] >> v[1],
                   "and.b32": lambda: v[0] & v[1], "or.b32": lambda: v[0] | v[1], "mul.lo.u32": lambda: v[0] * v[1]}[op]()
        reg[dst] = out & 0xFFFFFFFF
    return reg["%nv_r0"], reg["%nv_r1"]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_ptx_decode_programs(dtype):
    """The kernel's hand-written PTX decode (which only a GPU runs) executed here line by line on words of
    every code byte: float16 gives e2m1_pair_to_f16's values (the interpreter's model of it), bfloat16
    each e2m1 value times 2**-126 exactly (bit for bit, signs and the 0.5 subnormal included)."""
    rng = _rng(16)
    words = np.concatenate([np.arange(256, dtype=np.uint8).reshape(64, 4), rng.integers(0, 256, (64, 4), np.uint8)])
    for k, program in DECODE_PTX[jnp.dtype(dtype)].items():
        for word in words:
            r0, r1 = _run_ptx(program, int(word.view(np.uint32)[0]))
            got = np.array([r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16], np.uint16)
            nibbles = word & 15 if k == "lo" else word >> 4
            if dtype == jnp.float16:
                want = np.asarray(e2m1_pair_to_f16(jnp.asarray(word))[0 if k == "lo" else 1]).view(np.uint16)
            else:
                want = (np.asarray(E2M1_VALUES[nibbles] * 2.0**-126, np.float32).view(np.uint32) >> 16).astype(np.uint16)
            np.testing.assert_array_equal(got, want, err_msg=f"{k} of {word}")


def test_mma_operand_is_the_weight_in_mma_k_order():
    """The warp-level mma decode (GPU only) modelled thread by thread from the PTX ISA's fragments: each
    lane's m16n8k32 8-bit A word (row g or g + 8 of its warp's 16, bytes 4t..4t+3 of a 16-byte chunk; g =
    lane // 4, t = lane % 4) run through the bfloat16 PTX programs, times its block's scale, put where
    mma_operand_register says, read back as m16n8k16 bfloat16 A fragments (columns 2t, 2t + 1 and
    2t + 8, 2t + 9 of a 16-column tile): the operand is decode_tile's bfloat16 operand in mma_k_order."""
    rng = _rng(25)
    w = WEIGHTS["nvfp4"](rng, (), 64, 128)  # one 64-row tile, two 32-byte MMA_LHS(uint8) tiles
    codes, scales = np.asarray(w.packed), np.asarray(w.scale)  # [64, 64] uint8, [8, 64] e4m3
    unit = NVFP4Weight.operand_unit(jnp.bfloat16)
    bf16_bits = lambda bits: np.asarray(np.asarray(bits, np.uint32) << 16, np.uint32).view(np.float32)
    operand = np.zeros((64, 128), np.float32)
    for warp, lane, tile, half, rh in np.ndindex(4, 32, 2, 2, 2):
        g, t = lane // 4, lane % 4
        row, byte = 16 * warp + 8 * rh + g, 32 * tile + 16 * half + 4 * t
        word = int(codes[row, byte:byte + 4].view(np.uint32)[0])
        scale = np.float32(scales[byte // 8, row].astype(np.float32)) * np.float32(unit * 2.0**126)
        for nibble, k in enumerate(("lo", "hi")):
            r0, r1 = _run_ptx(DECODE_PTX[jnp.dtype(jnp.bfloat16)][k], word)
            for h, pair in enumerate((r0, r1)):
                _, f, _, h_out, rh_out, *_ = mma_operand_register(tile, half, rh, h, nibble)
                assert (h_out, rh_out) == (h, rh)
                col = 16 * f + 8 * h_out + 2 * t
                operand[row, col:col + 2] = bf16_bits([pair & 0xFFFF, pair >> 16]) * scale
    want = np.asarray(dequantize(dataclasses.replace(w, global_scale=jnp.float32(1.0))), np.float64) * unit  # exact
    np.testing.assert_array_equal(operand, np.asarray(NVFP4Weight.mma_k_order(jnp.asarray(want))))


def test_fp8_mma_operand_is_the_weight_in_mma_k_order():
    """The same model for FP8 codes (converted in registers, then relabelled): each lane's four e4m3 bytes
    of a row, as bfloat16 pairs where mma_operand_register says, read back as m16n8k16 A fragments, give
    the e4m3 values in FP8Weight.mma_k_order."""
    rng = _rng(28)
    w = WEIGHTS["fp8"](rng, (), 64, 64)
    codes = np.asarray(w.data.astype(jnp.float32))  # [64, 64]: the e4m3 values, exact in bfloat16
    operand = np.zeros((64, 64), np.float32)
    for warp, lane, tile, half, rh in np.ndindex(4, 32, 2, 2, 2):
        g, t = lane // 4, lane % 4
        row, byte = 16 * warp + 8 * rh + g, 32 * tile + 16 * half + 4 * t
        for h in range(2):
            _, f, _, h_out, rh_out, *_ = mma_operand_register(tile, half, rh, h)
            col = 16 * f + 8 * h_out + 2 * t
            operand[row, col:col + 2] = codes[row, byte + 2 * h:byte + 2 * h + 2]
    np.testing.assert_array_equal(operand, np.asarray(FP8Weight.mma_k_order(jnp.asarray(codes))))


def _same_products_under(variant, rng, w, up, down, rows, tilings, tokens):
    """A tiling option changes no output bit: linear of x ([n, K] of each (n, dtype) in rows) under
    variant(tiling) against tiling, for each of tilings, then moe_experts of each token count in tokens
    under variant(tilings[0]) against tilings[0]."""
    k = w.shape[-1]
    for n, dtype in rows:
        x = _x(rng, (n, k), dtype)
        for tiling in tilings:
            _same_bits(linear(x, w, impl=IMPL, tiling=variant(tiling)), linear(x, w, impl=IMPL, tiling=tiling),
                       f"{n} rows of {dtype.__name__}, {tiling}")
    for count in tokens:
        x = _x(rng, (count, k), jnp.bfloat16)
        idx, weight = _routes(rng, count)
        _same_bits(moe_experts(x, idx, weight, up, down, impl=IMPL, tiling=variant(tilings[0])),
                   moe_experts(x, idx, weight, up, down, impl=IMPL, tiling=tilings[0]), f"{count} tokens")


def _tiled_owner(layout, shape):
    """Model of a Mosaic GPU TiledLayout: element index of `shape` -> (warp, lane, register index, position
    in the register's vector), from the layout's tiling, warp and lane dims (the first the most
    significant; replicated warps and lanes hold copies: copy 0 here) and vector dim."""
    tiled = layout.tiling.tile_shape(shape)
    regs = layout.registers_shape(shape)
    warp_dims = [d for d in layout.warp_dims if isinstance(d, int)]

    def owner(index):
        index = tuple(index)
        for tile in layout.tiling.tiles:
            lead, tail = index[:-len(tile)], index[-len(tile):]
            index = lead + tuple(i // t for i, t in zip(tail, tile)) + tuple(i % t for i, t in zip(tail, tile))
        warp = lane = 0
        for d in warp_dims:
            warp = warp * tiled[d] + index[d]
        for d in layout.lane_dims:  # a replicated lane dim: copies in lanes apart by its stride (copy 0 here)
            lane = lane * tiled[d] + index[d] if isinstance(d, int) else lane * d.times
        own = (*warp_dims, *layout.lane_dims, layout.vector_dim)
        reg = tuple(0 if (d - len(tiled)) in own else i for d, i in enumerate(index))
        assert all(r < n for r, n in zip(reg, regs)), (reg, regs)
        return warp, lane, reg, index[layout.vector_dim]

    return owner


def test_mma_x_loads_are_x_in_mma_k_order():
    """Each format's activation load for warp-level mma (load_mma_x: x loaded in mma_x_layout, each
    register's pairs relabelled by mma_rhs_register into MMA_RHS(bfloat16)), modelled thread by thread:
    the layout model gives MMA_RHS(bfloat16) the PTX ISA's m16n8k16 B fragments (lane's pair h of 16-row
    tile f: rows 16 f + 8 h + 2 (lane % 4) + {0, 1}, column lane // 4); read back that way, the B operand
    is x in the format's mma_k_order, as the decoded weight is."""
    from jax.experimental.mosaic import gpu as mgpu

    tk = 64
    rhs = _tiled_owner(mgpu.MMALayouts(jnp.bfloat16, m_warps=4).rhs, (tk, 8))
    for k, n in np.ndindex(tk, 8):  # the model against the ISA's fragment layout
        _, lane, (f, _, h, *rest), e = rhs((k, n))
        assert not any(rest) and (k, n) == (16 * f + 8 * h + 2 * (lane % 4) + e, lane // 4)
    x = np.arange(tk * 8, dtype=np.float32).reshape(tk, 8)
    for fmt in (NVFP4Weight, FP8Weight):
        layout = fmt.mma_x_layout().to_mgpu()
        owner, regs = _tiled_owner(layout, (tk, 8)), layout.registers_shape((tk, 8))
        operand = np.full((tk, 8), np.nan, np.float32)
        for k, n in np.ndindex(tk, 8):
            _, lane, reg, e4 = owner((k, n))
            f, _, h, *_ = mma_rhs_register(int(np.ravel_multi_index(reg, regs)), e4 // 2)
            operand[16 * f + 8 * h + 2 * (lane % 4) + e4 % 2, lane // 4] = x[k, n]
        np.testing.assert_array_equal(operand, np.asarray(fmt.mma_k_order(jnp.asarray(x.T))).T, err_msg=fmt.__name__)


def test_mma_scale_pairs_hold_each_lanes_block():
    """NVFP4Weight.mma_scale_layout (Tiling.mma_scale_pairs), modelled thread by thread: of a chunk's two
    block-scale rows [2, 64], lane l of warp w holds in register rh the scale of row 16 w + 8 rh + l // 4
    (its rows of the mma A operand) for block (l % 4) // 2, the block of the code bytes 4 (l % 4) .. + 3 of
    the 16-byte chunk it decodes (m16n8k32's 8-bit A fragment), which _ptx_decode_mma reads as
    registers.flat[rh]; the other lane of each pair holds a copy."""
    layout = NVFP4Weight.mma_scale_layout().to_mgpu()
    owner, regs = _tiled_owner(layout, (2, 64)), layout.registers_shape((2, 64))
    assert regs == (1, 1, 1, 1, 1, 2, 1, 1, 1) and layout.vector_length == 1
    for block, row in np.ndindex(2, 64):
        warp, lane, reg, e = owner((block, row))
        rh = int(np.ravel_multi_index(reg, regs))
        assert (warp, 8 * rh + lane // 4, e) == (row // 16, row % 16, 0), (block, row)
        assert lane % 2 == 0 and (4 * (lane % 4)) // (NVFP4_BLOCK // 2) == block, (block, row, lane)


def test_mma_accumulator_stores_as_it_is():
    """The mma path's [64, 8] float32 accumulator (MMA_ACC) goes to the [tm, N] output with each register's
    two values split into registers of their own (_wgemm.ACC_SCALARS, one value each: a transposed
    store), none moved: the layout model gives MMA_ACC the PTX ISA's m16n8k16 C fragments (warp w's
    lane holds rows 16 w + 8 rh + lane // 4, columns 2 (lane % 4) + {0, 1}), and ACC_SCALARS puts each
    value in the same thread at the register the split writes (acc_scalar_register)."""
    from jax.experimental.mosaic import gpu as mgpu

    acc = _tiled_owner(mgpu.MMALayouts(jnp.bfloat16, m_warps=4).acc, (64, 8))
    scalars = _tiled_owner(_wgemm.ACC_SCALARS.to_mgpu(), (64, 8))
    for row, col in np.ndindex(64, 8):
        warp, lane, reg, e = acc((row, col))
        assert (row, col) == (16 * warp + 8 * reg[4] + lane // 4, 2 * (lane % 4) + e)
        assert scalars((row, col)) == (warp, lane, _wgemm.acc_scalar_register(reg, e), 0)


def test_mma_k_order_is_a_permutation_within_chunks():
    """Each format's mma_k_order moves elements only within its chunks, each chunk by the same
    permutation, so a product over K is unchanged (x and the operand permuted alike)."""
    rng = _rng(26)
    a, b = rng.normal(size=(3, 96)), rng.normal(size=(96,))
    for fmt in (NVFP4Weight, FP8Weight):
        c = fmt.MMA_K_CHUNK
        order = np.asarray(fmt.mma_k_order(jnp.arange(96)))
        assert sorted(order[:c]) == list(range(c)) and (order[c:2 * c] == order[:c] + c).all()
        assert (order != np.arange(96)).any()
        permuted = np.asarray(fmt.mma_k_order(jnp.asarray(a, jnp.float32)))
        np.testing.assert_array_equal(permuted, a.astype(np.float32)[:, order])
        np.testing.assert_allclose(a[:, order] @ b[order], a @ b, rtol=1e-12)


@gpu_only("warp-level mma and its PTX decode run on the GPU only")
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_mma_sync_products(fmt):
    """Tiling.mma_sync (the default) on the GPU: products of 1, 5 and 8 rows (one 8-row block), a split-K
    plan, one and three tokens' experts, against the float64 reference; and the wgmma path it replaces
    for such blocks, which mma_sync=False keeps."""
    rng = _rng(27)
    w = WEIGHTS[fmt](rng, (), 192, 640)
    up, down = WEIGHTS[fmt](rng, (4,), 192, 640), WEIGHTS[fmt](rng, (4,), 640, 192)
    for rows in (1, 5, 8):
        x = _x(rng, (rows, 640), jnp.bfloat16)
        for tiling in (Tiling(mma_sync=True), Tiling(mma_sync=True, decode_ctas_per_sm=2, ctas_per_sm=1),
                       Tiling(mma_sync=False)):
            _check(linear(x, w, impl=IMPL, tiling=tiling), _f64(x) @ _f64(dequantize(w)).T, TOL_F64[jnp.bfloat16],
                   f"{rows} rows, {tiling}")
    for tokens in (1, 3):
        x = _x(rng, (tokens, 640), jnp.bfloat16)
        idx, weight = _routes(rng, tokens)
        want = moe_experts(x, idx, weight, up, down, impl="xla")
        for mma in (True, False):
            _check(moe_experts(x, idx, weight, up, down, impl=IMPL, tiling=Tiling(mma_sync=mma)), _f64(want),
                   TOL_XLA, f"{tokens} tokens, mma_sync={mma}")


@gpu_only("warp-level mma, its PTX decode and its loads run on the GPU only")
@pytest.mark.parametrize("fmt, option, value", [("nvfp4", "mma_scale_pairs", True), ("nvfp4", "stagger_x_loads", False),
                                                 ("fp8", "stagger_x_loads", False)])
def test_mma_load_options_same_products(fmt, option, value):
    """Tiling options of what warp-level mma loads give the other setting's products bit for bit on the
    GPU: mma_scale_pairs (the default; NVFP4 block scales a chunk's pair at a time, each lane its own
    block's, against every row loaded whole and picked per lane) and stagger_x_loads=False (the default;
    activations by the plain load plan, against Mosaic's staggered one); 1, 5 and 8 rows, a split-K plan,
    one and three tokens' experts."""
    rng = _rng(29)
    w = WEIGHTS[fmt](rng, (), 192, 640)
    up, down = WEIGHTS[fmt](rng, (4,), 192, 640), WEIGHTS[fmt](rng, (4,), 640, 192)
    other = {option: not value}
    _same_products_under(lambda tiling: dataclasses.replace(tiling, **{option: value}), rng, w, up, down,
                         [(n, jnp.bfloat16) for n in (1, 5, 8)],
                         (Tiling(**other), Tiling(decode_ctas_per_sm=2, ctas_per_sm=1, **other)), (1, 3))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_stagger_x_loads_picks_the_load_plan(fmt, monkeypatch):
    """What Tiling.stagger_x_loads is: lowered for the GPU, a decode row's kernel loads its activations for
    warp-level mma by Mosaic GPU's staggered (bank-conflict-free) plan when it is on, and off (the
    default) it plans no activation load at all (the plain one); the weight codes' load plan is the same
    either way."""
    from jax import export
    from jax.experimental.mosaic.gpu import fragmented_array

    plans, plan = [], fragmented_array.plan_tiled_transfer

    def recorded(*args, **kwargs):
        planned = plan(*args, **kwargs)
        plans.append(type(planned).__name__)
        return planned

    monkeypatch.setattr(fragmented_array, "plan_tiled_transfer", recorded)
    rng = _rng(31)
    w, x = WEIGHTS[fmt](rng, (), 128, 640), _x(rng, (1, 640), jnp.bfloat16)
    for tiling, want in ((Tiling(stagger_x_loads=True), ["TrivialTransferPlan", "StaggeredTransferPlan"]),
                         (Tiling(), ["TrivialTransferPlan"])):
        plans.clear()
        export.export(jax.jit(lambda x, w: linear(x, w, impl="pallas", tiling=tiling)), platforms=["cuda"])(x, w)
        assert sorted(plans) == sorted(want), (tiling.stagger_x_loads, plans)


def test_row_scaling_is_frexp_and_ldexp():
    """The activations' per-row power-of-two scaling, built from float bits, is frexp/ldexp exactly for
    rows with a normal max (every magnitude bf16 reaches below 2**126), and the output's inverse scaling
    restores them; zero and subnormal rows scale by 2**126, non-finite rows stay non-finite."""
    rng = _rng(11)
    mags = np.exp2(rng.integers(-120, 120, (64, 1))).astype(np.float32)
    x = (rng.normal(size=(64, 48)) * mags).astype(np.float32)
    m = np.abs(x).max(axis=1)
    e = np.asarray(row_exponent(jnp.asarray(m)))
    np.testing.assert_array_equal(e, np.frexp(m)[1])
    scaled = jnp.asarray(x) * pow2(jnp.asarray(-e))[:, None]
    np.testing.assert_array_equal(np.asarray(scaled), np.ldexp(x, -e[:, None]))
    np.testing.assert_array_equal(np.asarray(scaled * pow2(jnp.asarray(e))[:, None]), x)  # undone
    tiny = np.float32(2.0**-140)
    edge = np.asarray(row_exponent(jnp.asarray([0.0, tiny, np.inf, np.nan, 2.0**127], jnp.float32)))
    np.testing.assert_array_equal(edge, [-126, -126, 126, 126, 126])
    assert np.isinf(float(jnp.float32(np.inf) * pow2(jnp.int32(-126))))


def test_nvfp4_layout_round_trip():
    rng = _rng(5)
    packed = rng.integers(0, 256, (3, 8, 24), dtype=np.uint8)
    block = rng.uniform(0.05, 4.0, (3, 8, 3)).astype(np.float32).astype(jnp.float8_e4m3fn)
    w = NVFP4Weight.from_hf(packed, block, np.ones(3, np.float32))
    assert w.packed.shape == (3, 8, 24) and w.scale.shape == (3, 3, 8)
    assert not np.array_equal(np.asarray(w.packed), packed)  # the kernel layout really moves nibbles
    hf = w.to_hf()
    np.testing.assert_array_equal(np.asarray(hf["weight"]), packed)
    np.testing.assert_array_equal(np.asarray(hf["weight_scale"]).view(np.uint8), block.view(np.uint8))
    values = np.stack([E2M1_VALUES[packed & 15], E2M1_VALUES[packed >> 4]], -1).reshape(3, 8, 48)
    expect = values * np.repeat(block.astype(np.float32), 16, axis=-1)
    np.testing.assert_array_equal(np.asarray(dequantize(w)), expect)


# (leading dims, N, K): odd M, N not a multiple of the 64-row tile, K = 16 * odd, several row blocks.
LINEAR_CASES = [((13,), 200, 144, jnp.bfloat16), ((13,), 200, 144, jnp.float32),
                ((2, 3), 72, 48, jnp.bfloat16), ((130,), 72, 48, jnp.float32)]


def test_large_quantised_products_dequantise_then_dot():
    """Past QUANT_KERNEL_MAX_ROWS rows a quantised linear is compute-bound: it runs the dequantise-then-dot
    reference (bit for bit), not the weight-streaming kernel; at the limit it still runs the kernel. FP8
    W8A8 runs its fp8 GEMM at any size."""
    from pallas_kernels.linear import QUANT_KERNEL_MAX_ROWS, fp8_w8a8

    rng = _rng(3)
    w = WEIGHTS["nvfp4"](rng, (), 64, 48)
    x = _x(rng, (QUANT_KERNEL_MAX_ROWS + 1, 48), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(linear(x, w, impl=IMPL)), np.asarray(linear(x, w, impl="xla")))
    at_limit = x[:QUANT_KERNEL_MAX_ROWS].astype(jnp.float32)
    assert not np.array_equal(np.asarray(linear(at_limit, w, impl=IMPL)), np.asarray(linear(at_limit, w, impl="xla")))
    w8a8 = dataclasses.replace(WEIGHTS["fp8"](rng, (), 64, 48), input_scale=jnp.float32(0.01))  # native fp8 GEMM
    np.testing.assert_array_equal(np.asarray(linear(x, w8a8, impl=IMPL)), np.asarray(fp8_w8a8(x, w8a8)))


def test_nvfp4_tiny_block_scales_keep_their_products():
    """Block scales among e4m3's subnormals (2**-9 .. 7 * 2**-9) make every MMA operand value a float16
    subnormal (the decode leaves W's values times 2**-6): the products must survive, not flush to zero.
    On a GPU (PALLAS_KERNELS_IMPL=pallas) this checks the tensor cores' subnormal inputs."""
    rng = _rng(12)
    packed = rng.integers(0, 256, (128, 96), dtype=np.uint8)
    block = jnp.asarray(rng.integers(1, 8, (128, 12)).astype(np.float32) * 2.0**-9).astype(jnp.float8_e4m3fn)
    w = NVFP4Weight.from_hf(packed, block, np.float32(1.0))
    x = _x(rng, (1, 192), jnp.float32)
    _check(linear(x, w, impl=IMPL), _f64(x) @ _f64(dequantize(w)).T, TOL_F64[jnp.float32], "nvfp4 tiny scales")
    x16 = x.astype(jnp.bfloat16)  # bfloat16 operands (the default for bf16 x): the same products, all normal
    np.testing.assert_array_equal(np.asarray(linear(x16, w, impl=IMPL), np.float32),
                                  np.asarray(linear(x16, w, impl=IMPL, tiling=Tiling(bf16_operands=False)), np.float32))


@pytest.mark.parametrize("fmt,lead,n,k,dtype", [(fmt, *case) for fmt in ("nvfp4", "fp8", "dense")
                                                 for case in LINEAR_CASES
                                                 if fmt != "dense" or case[-1] == jnp.bfloat16])  # f32 dense: XLA
def test_linear(fmt, lead, n, k, dtype):
    rng = _rng(1)
    x, w = _x(rng, (*lead, k), dtype), WEIGHTS[fmt](rng, (), n, k)
    y = linear(x, w, impl=IMPL)
    assert y.dtype == dtype
    ref64 = _f64(x) @ _f64(dequantize(w)).T
    _check(y, ref64, TOL_F64[dtype], f"{fmt} vs f64")
    _check(y, linear(x, w, impl="xla"), TOL_XLA, f"{fmt} vs xla")


# T=5 tokens, k=3 of E=6 experts, H=80 (16*5), F=48 (16*3); experts repeat across tokens, expert 4 unused.
T, TOPK, E, H, F = 5, 3, 6, 80, 48
EXPERT_IDX = np.array([[0, 2, 3], [2, 3, 0], [5, 2, 1], [2, 0, 3], [1, 2, 5]], np.int32)
UNUSED = 4


def _moe_inputs(fmt, dtype, seed=3):
    rng = _rng(seed)
    x = _x(rng, (T, H), dtype)
    weight = jnp.asarray(rng.uniform(0.1, 1.0, (T, TOPK)).astype(np.float32))
    return x, jnp.asarray(EXPERT_IDX), weight, WEIGHTS[fmt](rng, (E,), F, H), WEIGHTS[fmt](rng, (E,), H, F)


def _moe_f64(x, idx, weight, up, down):
    up64, down64, x64 = _f64(dequantize(up)), _f64(dequantize(down)), _f64(x)
    y = np.zeros((T, H))
    for t in range(T):
        for j in range(TOPK):
            e = int(idx[t, j])
            y[t] += float(weight[t, j]) * (down64[e] @ np.square(np.maximum(up64[e] @ x64[t], 0.0)))
    return y


def _poison(w, e):
    """Copy of stacked weight w with expert e's values replaced by NaN."""
    if isinstance(w, NVFP4Weight):
        return NVFP4Weight(w.packed, w.scale.at[e].set(jnp.nan), w.global_scale)
    if isinstance(w, FP8Weight):
        return FP8Weight(w.data.at[e].set(jnp.nan), w.scale)
    return w.at[e].set(jnp.nan)


@pytest.mark.parametrize("fmt,dtype", [("dense", jnp.bfloat16), ("fp8", jnp.bfloat16),
                                       ("nvfp4", jnp.bfloat16), ("nvfp4", jnp.float32)])
def test_moe_experts(fmt, dtype):
    x, idx, weight, up, down = _moe_inputs(fmt, dtype)
    y = moe_experts(x, idx, weight, up, down, impl=IMPL)
    assert y.dtype == dtype
    tol = 8e-3 if dtype == jnp.bfloat16 else TOL_F64[dtype]
    _check(y, _moe_f64(x, idx, weight, up, down), tol, f"moe {fmt} vs f64")
    _check(y, moe_experts(x, idx, weight, up, down, impl="xla"), TOL_XLA, f"moe {fmt} vs xla")


@pytest.mark.parametrize("fmt", ["dense", "fp8", "nvfp4"])
def test_moe_reads_only_selected_experts(fmt):
    x, idx, weight, up, down = _moe_inputs(fmt, jnp.bfloat16)
    clean = moe_experts(x, idx, weight, up, down, impl=IMPL)
    unselected = moe_experts(x, idx, weight, _poison(up, UNUSED), _poison(down, UNUSED), impl=IMPL)
    np.testing.assert_array_equal(np.asarray(unselected, np.float32), np.asarray(clean, np.float32))
    selected = moe_experts(x, idx, weight, up, _poison(down, 5), impl=IMPL)
    uses_5 = (EXPERT_IDX == 5).any(axis=1)
    nan_rows = np.isnan(np.asarray(selected, np.float32)).any(axis=1)
    np.testing.assert_array_equal(nan_rows, uses_5)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_moe_experts_single_token(fmt):
    """Decode (T=1) takes the one-block-per-expert path; NaN in an unselected expert must not leak."""
    x, _, weight, up, down = _moe_inputs(fmt, jnp.bfloat16)
    x, weight, idx = x[:1], weight[:1], jnp.asarray(EXPERT_IDX[2:3])  # experts 5, 2, 1
    y = moe_experts(x, idx, weight, _poison(up, UNUSED), _poison(down, UNUSED), impl=IMPL)
    up64, down64, x64 = _f64(dequantize(up)), _f64(dequantize(down)), _f64(x)[0]
    ref = sum(float(weight[0, j]) * (down64[e] @ np.square(np.maximum(up64[e] @ x64, 0.0)))
              for j, e in enumerate(EXPERT_IDX[2]))
    _check(y, ref[None], 8e-3, f"moe T=1 {fmt} vs f64")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_one_token_experts_share_the_activation_preparation(fmt):
    """At T=1 the routed experts read the token's row block, the very block a projection of the same x
    reads (the shared expert's), so the compiled program prepares x once where activations go to the
    kernel as rescaled float16: three row-max reductions (x; the shared hidden; the routed hidden), not
    four (a gathered copy of x had its own)."""
    rng = _rng(10)
    x, _, weight, up, down = _moe_inputs(fmt, jnp.bfloat16)
    shared_up, shared_down = WEIGHTS[fmt](rng, (), 32, H), WEIGHTS[fmt](rng, (), H, 32)
    f16 = Tiling(bf16_operands=False)

    def layer(x, idx, weight, up, down, shared_up, shared_down):
        hidden = jnp.square(jnp.maximum(linear(x, shared_up, impl=IMPL, tiling=f16), 0.0))
        return moe_experts(x, idx, weight, up, down, impl=IMPL, tiling=f16) + linear(hidden, shared_down, impl=IMPL,
                                                                                   tiling=f16)

    args = (x[:1], jnp.asarray(EXPERT_IDX[2:3]), weight[:1], up, down, shared_up, shared_down)
    hlo = jax.jit(layer).lower(*args).compile().as_text()
    reduced = re.findall(r"= f32\[([\d,]*)\]\S* reduce\(", hlo)
    row_maxima = [shape for shape in reduced if not shape.endswith(f",{H}")]  # [T, H]: the weighted sum
    assert len(row_maxima) == 3, row_maxima


@pytest.mark.parametrize("block_pairs", [moe_ops.COUNT_BLOCK_PAIRS, 8, 5])
def test_route_blocks_covers_every_pair_once(block_pairs, monkeypatch):
    """Pairs counted in one block (a decode batch's) or in several (larger batches': earlier blocks'
    counts added, 5 leaving a partial last block) fill every block slot in pair order."""
    monkeypatch.setattr(moe_ops, "COUNT_BLOCK_PAIRS", block_pairs)
    rng = _rng(4)
    idx = jnp.asarray(rng.integers(0, 7, (9, 4)).astype(np.int32))
    slot_pair, block_expert, pair_slot = map(np.asarray, jax.jit(route_blocks, static_argnums=(1, 2))(idx, 7, 8))
    pairs = idx.size
    filled = slot_pair[slot_pair < pairs]
    np.testing.assert_array_equal(np.sort(filled), np.arange(pairs))
    np.testing.assert_array_equal(slot_pair[pair_slot], np.arange(pairs))  # the inverse map
    flat = np.asarray(idx).reshape(-1)
    for slot in np.nonzero(slot_pair < pairs)[0]:
        assert block_expert[slot // 8] == flat[slot_pair[slot]]
    assert (block_expert >= 0).sum() == sum(-(-np.sum(flat == e) // 8) for e in range(7))
    for e in range(7):  # an expert's pairs sit in its blocks in pair order
        slots = np.nonzero(block_expert[np.arange(slot_pair.size) // 8] == e)[0]
        np.testing.assert_array_equal(slot_pair[slots][slot_pair[slots] < pairs], np.nonzero(flat == e)[0])


def test_route_blocks_counted_in_blocks_agree():
    """Counting in one block and in blocks of 8 or 7 pairs (earlier blocks' counts added) give the same
    blocks, left-out pairs included, and each pair's slot follows a stable sort by expert."""
    rng = _rng(17)
    idx = jnp.asarray(np.stack([rng.choice(11, 3, replace=False) for _ in range(40)]).astype(np.int32))
    valid = jnp.asarray(rng.random((40, 3)) < 0.7)
    whole = route_blocks(idx, 11, 8, valid)
    for block_pairs in (8, 7):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe_ops, "COUNT_BLOCK_PAIRS", block_pairs)
            blocked = route_blocks(idx, 11, 8, valid)
        for a, b in zip(whole, blocked):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    flat = np.where(np.asarray(valid).reshape(-1), np.asarray(idx).reshape(-1), 11)
    kept = np.argsort(flat, kind="stable")[: int(np.asarray(valid).sum())]
    np.testing.assert_array_equal(np.argsort(np.asarray(whole[2])[kept], kind="stable"), np.arange(kept.size))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "dense"])
def test_kernels_lower_for_the_gpu(fmt, monkeypatch):
    """The GPU kernels lower to Mosaic GPU on a CPU-only machine (export for "cuda"): register layouts,
    TMA block shapes, the decode's register ops and the shared memory budget are checked in CI, not
    first on the GPU; at lane level (Tiling.lane_lowering, the default) and at warpgroup level."""
    from jax import export

    rng = _rng(6)
    w, up, down = WEIGHTS[fmt](rng, (), 256, 2688), WEIGHTS[fmt](rng, (4,), 1856, 2688), WEIGHTS[fmt](rng, (4,), 2688, 1856)
    for rows in (1, 13, 40):  # 13: a block's rows past one SMEM tile but not a multiple of it
        x = _x(rng, (rows, 2688), jnp.bfloat16)
        export.export(jax.jit(lambda x, w: linear(x, w, impl="pallas")), platforms=["cuda"])(x, w)
    # decode blocks of 8 rows, prefill blocks of 64; and the long K step that big decode grids take
    def experts(tokens, tiling):
        idx, weight = jnp.zeros((tokens, 2), jnp.int32), jnp.ones((tokens, 2), jnp.float32)
        export.export(jax.jit(lambda *a: moe_experts(*a, impl="pallas", tiling=tiling)), platforms=["cuda"])(
            _x(rng, (tokens, 2688), jnp.bfloat16), idx, weight, up, down)

    for rows in (1, 40):  # fewer rows than a block, padded
        export.export(jax.jit(lambda x, w: linear(x, w, impl="pallas", tiling=Tiling(unpadded_rows=False))),
                      platforms=["cuda"])(_x(rng, (rows, 2688), jnp.bfloat16), w)
    for tokens, tiling in ((1, None), (100, None), (1, Tiling(tk=128)), (1, Tiling(bf16_operands=False)),
                           (100, Tiling(bf16_operands=False)), (1, Tiling(unpadded_rows=False)), (3, None),
                           (1, Tiling(mma_sync=False)), (3, Tiling(mma_sync=False)), (1, Tiling(store_real_rows=False)),
                           (1, Tiling(store_real_rows=False, mma_sync=False)), (1, Tiling(mma_scale_pairs=False)),
                           (3, Tiling(mma_scale_pairs=False)), (1, Tiling(stagger_x_loads=True)),
                           (3, Tiling(stagger_x_loads=True))):
        experts(tokens, tiling)
    # on one SM every grid fills the GPU, so the weight tiles a CTA are taken: the default three with
    # 128-row blocks is the largest pipeline (FP8: 224 KiB of the 227 KiB of shared memory)
    monkeypatch.setattr(_blocked, "num_sms", lambda: 1)
    export.export(jax.jit(lambda x, w: linear(x, w, impl="pallas")), platforms=["cuda"])(
        _x(rng, (256, 2688), jnp.bfloat16), w)
    for tokens, tiling in ((300, None), (300, Tiling(moe_block_rows=128)), (32, Tiling(decode_weight_tiles=2)),
                           (300, Tiling(lane_lowering=False)), (32, Tiling(lane_lowering=False)),
                           (1, Tiling(lane_lowering=False)), (1, Tiling(lane_lowering=False, mma_sync=False)),
                           (100, Tiling(lane_lowering=False, bf16_operands=False)), (300, Tiling(fused_relu2=False))):
        experts(tokens, tiling)


@pytest.mark.parametrize("fmt,tk", [("nvfp4", 32), ("fp8", 64), ("dense", 64)])
@pytest.mark.parametrize("ctas_per_sm", [2, 4])
def test_k_steps_past_the_activations(fmt, tk, ctas_per_sm, monkeypatch):
    """x is not padded along K when K is a whole number of SMEM tiles: split-K plans whose last split
    runs whole K steps past the data (5 steps of K as 2 x 3 or 3 x 2) read zeros there, from x as from
    the weight and its scales."""
    monkeypatch.setattr(_blocked, "num_sms", lambda: 1)  # ctas_per_sm CTAs in all: that many splits
    rng = _rng(9)
    x, w = _x(rng, (2, 320), jnp.bfloat16), WEIGHTS[fmt](rng, (), 64, 320)
    tiling = Tiling(tk=tk, ctas_per_sm=ctas_per_sm, decode_ctas_per_sm=ctas_per_sm)
    fmt_class = type(w) if fmt != "dense" else None
    _, splits, k_total, _ = _plan(fmt_class, (w.stream()[0] if fmt_class else w).dtype, 320, 8, 1, 1, tiling)
    assert splits > 1 and k_total - 320 >= 64, (splits, k_total)  # a whole step of each split-K plan past K
    _check(linear(x, w, impl=IMPL, tiling=tiling), _f64(x) @ _f64(dequantize(w)).T, TOL_F64[jnp.bfloat16], fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "dense"])
def test_unpadded_rows_same_products(fmt):
    """Activations that fill less than one block, sent to the kernel without a padded copy
    (Tiling.unpadded_rows, the default: the kernel loads zeros past their last row), give the padded
    path's outputs bit for bit: 1, 5, 13 and 40 rows (8- and 64-row blocks; 13 rows go as 16, a TMA copy's
    rows being fewer than an SMEM tile's 8 or a multiple of them), float32 rows (whose exponents are
    undone per row), a split-K plan and one token's experts; a full block and a multi-token MoE batch keep
    their blocks as they were."""
    rng = _rng(23)
    w = WEIGHTS[fmt](rng, (), 128, 320)
    up, down = WEIGHTS[fmt](rng, (4,), 192, 320), WEIGHTS[fmt](rng, (4,), 320, 192)
    # float32 rows: rescaled float16 rows, each with its exponent to undo
    _same_products_under(lambda tiling: dataclasses.replace(tiling, unpadded_rows=True), rng, w, up, down,
                         [(1, jnp.bfloat16), (5, jnp.bfloat16), (8, jnp.bfloat16), (13, jnp.bfloat16),
                          (40, jnp.bfloat16), (5, jnp.float32)],
                         (Tiling(unpadded_rows=False), Tiling(decode_ctas_per_sm=2, ctas_per_sm=1, unpadded_rows=False)),
                         (1, 3))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "dense"])
def test_store_real_rows_same_products(fmt):
    """Tiling.store_real_rows (the default): a block's kernel stores only its activations' rows of the
    partial sums (1 row; 20 rows, sent as 24 of a 32-row block: past one SMEM tile; float32 rows with
    exponents to undo; a split-K plan), and a one-token MoE one hidden row a block; the outputs are the
    all-rows path's bit for bit, and the kernel's product holds those rows only."""
    rng = _rng(25)
    w = WEIGHTS[fmt](rng, (), 128, 320)
    up, down = WEIGHTS[fmt](rng, (4,), 192, 320), WEIGHTS[fmt](rng, (4,), 320, 192)
    rows = [(1, jnp.bfloat16), (20, jnp.bfloat16), (5, jnp.float32)]
    _same_products_under(lambda tiling: dataclasses.replace(tiling, store_real_rows=True), rng, w, up, down, rows,
                         (Tiling(store_real_rows=False), Tiling(decode_ctas_per_sm=2, ctas_per_sm=1, store_real_rows=False)),
                         (1,))
    one_expert = jax.tree.map(lambda a: a[None], w)
    for n, dtype in rows:
        tm = _blocked.block_rows(n)
        xb = _blocked.row_blocks(jnp.zeros((n, 320), dtype), tm)
        held = lambda tiling: _blocked.blocked_linear(xb, jnp.zeros((1,), jnp.int32), one_expert, IMPL, tiling, tm).shape
        assert held(Tiling()) == (1, xb.shape[1], 128) and held(Tiling(store_real_rows=False)) == (1, tm, 128), xb.shape
        assert xb.shape[1] < tm, (n, xb.shape, tm)


def test_unpadded_rows_drop_the_pad():
    """What unpadded_rows is for: a one-row projection traces to no pad of its activations."""
    rng = _rng(24)
    w = WEIGHTS["nvfp4"](rng, (), 128, 320)
    pads = lambda tiling: str(jax.make_jaxpr(lambda x: linear(x, w, impl=IMPL, tiling=tiling))(
        _x(rng, (1, 320), jnp.bfloat16))).count(" pad[")
    assert pads(Tiling(unpadded_rows=False)) == 1 and pads(Tiling()) == 0


@gpu_only("the interpreter takes no lowering: both sides would be one run")
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "dense"])
def test_lane_lowering_same_products(fmt, monkeypatch):
    """Tiling.lane_lowering (the default: Mosaic GPU's lane-level lowering) gives the warpgroup-level
    lowering's outputs bit for bit on the GPU: the same operations in the same order, lowered by another
    route. Decode rows (warp-level mma for the quantised formats, wgmma with mma_sync=False), a split-K
    plan, float32 rows, prefill-size blocks with three weight tiles a CTA, one, three and 100 tokens'
    experts."""
    rng = _rng(28)
    w = WEIGHTS[fmt](rng, (), 192, 640)
    up, down = WEIGHTS[fmt](rng, (4,), 192, 640), WEIGHTS[fmt](rng, (4,), 640, 192)
    warpgroup = lambda tiling: dataclasses.replace(tiling, lane_lowering=False)
    _same_products_under(warpgroup, rng, w, up, down,
                         [(1, jnp.bfloat16), (5, jnp.bfloat16), (5, jnp.float32), (40, jnp.bfloat16)],
                         (Tiling(), Tiling(mma_sync=False), Tiling(decode_ctas_per_sm=2, ctas_per_sm=1)), (1, 3, 100))
    monkeypatch.setattr(_blocked, "num_sms", lambda: 1)  # a grid that fills the GPU: three tiles a CTA
    x = _x(rng, (256, 640), jnp.bfloat16)
    _same_bits(linear(x, w, impl=IMPL, tiling=Tiling()), linear(x, w, impl=IMPL, tiling=warpgroup(Tiling())), "256 rows")


def test_lane_lowering_skips_layout_inference(monkeypatch):
    """What lane_lowering (the default) is for: the kernels lower for the GPU without Mosaic GPU's
    layout-inference pass (the warpgroup-level lowering runs it once a kernel)."""
    from jax import export
    from jax.experimental.mosaic.gpu import layout_inference

    passes = []
    infer = layout_inference.infer_layout
    monkeypatch.setattr(layout_inference, "infer_layout", lambda *a, **k: (passes.append(1), infer(*a, **k))[1])
    rng = _rng(29)
    w, x = WEIGHTS["nvfp4"](rng, (), 128, 640), _x(rng, (1, 640), jnp.bfloat16)
    lowered = lambda tiling: export.export(jax.jit(lambda x, w: linear(x, w, impl="pallas", tiling=tiling)),
                                           platforms=["cuda"])(x, w)
    lowered(Tiling())
    assert not passes
    lowered(Tiling(lane_lowering=False))
    assert len(passes) == 1


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "dense"])
def test_several_weight_tiles_per_cta(fmt, monkeypatch):
    """A CTA multiplying 2 or 4 weight tiles with each activation tile it reads gives the one-tile
    kernel's outputs bit for bit (each output takes the same K steps in the same order), also where the
    last CTA's tiles run past N (192 rows: 2 x 2 tiles, 1 x 4), for prefill-size and decode-size blocks
    (on one SM, whose grid they fill); a grid that would no longer fill the GPU keeps one tile."""
    monkeypatch.setattr(_blocked, "num_sms", lambda: 1)
    rng = _rng(15)
    w = WEIGHTS[fmt](rng, (), 192, 320)
    for rows in (40, 4):
        x = _x(rng, (rows, 320), jnp.bfloat16)
        one = linear(x, w, impl=IMPL, tiling=Tiling(ctas_per_sm=1, decode_ctas_per_sm=1, weight_tiles=1))
        for tiles in (2, 4):
            tiling = Tiling(ctas_per_sm=1, decode_ctas_per_sm=1, weight_tiles=tiles, decode_weight_tiles=tiles)
            got = linear(x, w, impl=IMPL, tiling=tiling)
            _same_bits(got, one, f"{rows} rows, {tiles} tiles")
        _check(one, _f64(x) @ _f64(dequantize(w)).T, TOL_F64[jnp.bfloat16], fmt)
    monkeypatch.undo()
    fmt_class = type(w) if fmt != "dense" else None
    stream = (w.stream()[0] if fmt_class else w).dtype
    plan_tiles = lambda tm, n_tiles, blocks, tiling: _plan(fmt_class, stream, 320, tm, n_tiles, blocks, tiling)[3]
    assert plan_tiles(64, 30, 10**4, Tiling(weight_tiles=2)) == 2  # a prefill grid
    assert plan_tiles(64, 3, 1, Tiling(weight_tiles=2)) == 1  # too few CTAs with 2 tiles each
    assert plan_tiles(8, 30, 10**4, Tiling(weight_tiles=2)) == 1  # decode-size blocks: decode_weight_tiles
    assert plan_tiles(8, 30, 10**4, Tiling(decode_weight_tiles=2)) == 2


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_bf16_operands_give_the_float16_paths_products(fmt):
    """bf16 activations go to the kernel as they are and the weight decodes to bfloat16 (W's values
    times operand_unit): where no entry of a row falls below 2**-14 of the row's max, every product is
    the float16 path's times a power of two, so the outputs are bit for bit those of bf16_operands=False,
    for a linear and the experts at 1 and at several tokens; float32 activations take the float16 path
    either way. On a GPU (PALLAS_KERNELS_IMPL=pallas) this checks the PTX decode to bfloat16, whose e2m1
    0.5 codes pass through bfloat16 subnormals."""
    rng = _rng(14)
    f16 = Tiling(bf16_operands=False)
    w = WEIGHTS[fmt](rng, (), 128, 320)
    for rows, dtype in ((1, jnp.bfloat16), (40, jnp.bfloat16), (1, jnp.float32)):
        x = _x(rng, (rows, 320), dtype)
        got = linear(x, w, impl=IMPL)
        _same_bits(got, linear(x, w, impl=IMPL, tiling=f16), f"{fmt} rows={rows}")
        _check(got, _f64(x) @ _f64(dequantize(w)).T, TOL_F64[dtype], f"{fmt} rows={rows}")
    up, down = WEIGHTS[fmt](rng, (4,), 64, 320), WEIGHTS[fmt](rng, (4,), 320, 64)
    for tokens in (1, 5):
        x = _x(rng, (tokens, 320), jnp.bfloat16)
        idx, weight = jnp.asarray(rng.integers(0, 4, (tokens, 2)).astype(np.int32)), jnp.ones((tokens, 2), jnp.float32)
        np.testing.assert_array_equal(
            np.asarray(moe_experts(x, idx, weight, up, down, impl=IMPL), np.float32),
            np.asarray(moe_experts(x, idx, weight, up, down, impl=IMPL, tiling=f16), np.float32))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_bf16_operands_keep_a_rows_small_entries(fmt):
    """A row whose entries lie far below its max (relu**2 activations have such rows): rescaled to
    float16 they become subnormals that keep a few bits, as bfloat16 operands they stay whole. So the
    default is the more exact of the two paths there, not the float16 path's bit for bit. The weight's
    column under the row's max is zero, so the output is the small entries' sum alone: on tensor cores a
    large product in the same sum would absorb their low bits in either path."""
    rng = _rng(16)
    w = WEIGHTS[fmt](rng, (), 64, 320)
    if fmt == "nvfp4":  # element 0 is the low nibble of each row's first byte
        w = dataclasses.replace(w, packed=w.packed.at[:, 0].set(w.packed[:, 0] & 0xF0))
    else:
        w = dataclasses.replace(w, data=w.data.at[:, 0].set(0))
    x = np.asarray(_x(rng, (2, 320), jnp.float32)) * 2.0**-20  # float16 subnormals of about three bits
    x[:, 0] = 1.0
    x = jnp.asarray(x, jnp.bfloat16)
    ref = _f64(x) @ _f64(dequantize(w)).T
    assert np.abs(ref).max() < 2.0**-10  # the max's product is zero: the small entries make the output
    stacked = jax.tree.map(lambda a: a[None], w)  # the blocked product's float32 output: no output rounding
    product = lambda tiling: _blocked.blocked_linear(_blocked.row_blocks(x, 8, tiling), jnp.zeros((1,), jnp.int32),
                                                     stacked, IMPL, tiling, 8)[0, :2]
    err = lambda tiling: np.abs(np.asarray(product(tiling), np.float64) - ref).max()
    bf16_err, f16_err = err(Tiling()), err(Tiling(bf16_operands=False))
    assert bf16_err * 3 < f16_err, (bf16_err, f16_err)


def test_bf16_operands_drop_the_activation_preparation():
    """What bf16_operands is for: a bf16 projection of a quantised weight traces to no row max and no
    rescale of its activations (the two XLA launches before each kernel), float32 ones still do."""
    rng = _rng(15)
    w = WEIGHTS["nvfp4"](rng, (), 128, 320)

    def reduce_maxes(x, tiling):
        jaxpr = jax.make_jaxpr(lambda x: linear(x, w, impl=IMPL, tiling=tiling))(x)
        return str(jaxpr).count("reduce_max")

    x = _x(rng, (1, 320), jnp.bfloat16)
    assert reduce_maxes(x, Tiling(bf16_operands=False)) == 1 and reduce_maxes(x, Tiling()) == 0
    assert reduce_maxes(x.astype(jnp.float32), Tiling()) == 1


def test_nvfp4_long_k_steps_only_where_the_grid_fills_the_gpu():
    """NVFP4 streams 128 bytes a K step only for decode-size blocks whose grid fills the GPU without
    split-K (the experts of a batch-32 step), where it pays; elsewhere 64 bytes, whose kernels lower
    in half the time. Other formats: 128 bytes everywhere."""
    sms = num_sms()
    plan = lambda fmt, dtype, tm, n_tiles, blocks: _plan(fmt, dtype, 2688, tm, n_tiles, blocks, Tiling())[0]
    assert plan(NVFP4Weight, jnp.uint8, 8, 29, 4 * sms) == 128  # many expert blocks: no split-K
    assert plan(NVFP4Weight, jnp.uint8, 8, 29, 6) == 64  # one token's six experts: split-K
    assert plan(NVFP4Weight, jnp.uint8, 32, 161, 1) == 64  # a GEMV of 32 rows
    assert plan(NVFP4Weight, jnp.uint8, 64, 29, 4 * sms) == 64  # prefill blocks
    assert plan(FP8Weight, jnp.float8_e4m3fn, 64, 29, 6) == 128


def test_decode_size_blocks_split_k_for_more_ctas(monkeypatch):
    """Blocks of up to 8 rows plan split-K for decode_ctas_per_sm CTAs per SM, larger blocks for
    ctas_per_sm: a GEMV 2688 -> 10304 (161 weight tiles of NVFP4, 21 K steps) on 132 SMs."""
    monkeypatch.setattr(_blocked, "num_sms", lambda: 132)
    splits = lambda tm, tiling: _plan(NVFP4Weight, jnp.uint8, 2688, tm, 161, 1, tiling)[1]
    assert splits(8, Tiling()) == 7 and splits(32, Tiling()) == 4  # 7 x 3 steps for 8 rows, 4 x 6 for 32
    assert splits(8, Tiling(decode_ctas_per_sm=4)) == 4 and splits(32, Tiling(ctas_per_sm=8)) == 7


@pytest.mark.parametrize("tokens", [32, 300])
def test_moe_experts_many_tokens_have_no_loop(tokens):
    """The routed-experts op for a batch of tokens (expert blocks built by route_blocks) traces to no
    while loop: inside the decode step a loop splits the step's CUDA graph and runs its iterations one
    by one (the binary search of jnp.searchsorted's default method was one). Nor to a sort: grouping the
    pairs by expert is a compare-and-count, in one block of pairs (a decode batch's 64) or several (600,
    a prefill's), where an argsort was a sort kernel on the critical path."""
    rng = _rng(9)
    up, down = WEIGHTS["nvfp4"](rng, (8,), 64, 128), WEIGHTS["nvfp4"](rng, (8,), 128, 64)
    idx = jnp.asarray(rng.integers(0, 8, (tokens, 2)).astype(np.int32))
    args = (_x(rng, (tokens, 128), jnp.bfloat16), idx, jnp.ones((tokens, 2), jnp.float32), up, down)
    jaxpr = jax.make_jaxpr(lambda *a: moe_experts(*a, impl="pallas"))(*args)

    kernel_calls = {"pallas_call", "mpmd_map"}  # how plgpu.kernel appears; loops inside a kernel are fine
    names = {eqn.primitive.name for eqn in equations(jaxpr.jaxpr, opaque=kernel_calls)}
    assert names & kernel_calls and "wgmma_wait" not in names, names  # the kernels are there, not entered
    assert not names & {"while", "scan", "sort"}, sorted(names)


@pytest.mark.parametrize("fmt,rows,sms", [("nvfp4", 64, None), ("dense", 64, None), ("nvfp4", 128, None), ("nvfp4", 64, 1),
                                          ("dense", 64, 1)])
def test_moe_experts_prefill_blocks(fmt, rows, sms, monkeypatch):
    """Many tokens (prefill): 64-row expert blocks in the kernel (128 where the tiling allows them), and
    the sorted ragged_dot reference; on one SM the down projection's CTAs take two weight tiles each,
    the second past its 80 rows."""
    from pallas_kernels.moe import block_rows_for
    from pallas_kernels.reference import GATHER_MAX_PAIRS

    if sms:
        monkeypatch.setattr(_blocked, "num_sms", lambda: sms)
    rng = _rng(7)
    tokens = 140
    tiling = Tiling(moe_block_rows=rows)
    idx = np.stack([rng.permutation(E)[:TOPK] for _ in range(tokens)]).astype(np.int32)
    x = _x(rng, (tokens, H), jnp.bfloat16)
    weight = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, TOPK)).astype(np.float32))
    up, down = WEIGHTS[fmt](rng, (E,), F, H), WEIGHTS[fmt](rng, (E,), H, F)
    assert idx.size > GATHER_MAX_PAIRS and block_rows_for(idx.size, E, tiling.moe_block_rows) == rows
    up64, down64, x64 = _f64(dequantize(up)), _f64(dequantize(down)), _f64(x)
    ref = np.zeros((tokens, H))
    for t in range(tokens):
        for j, e in enumerate(idx[t]):
            ref[t] += float(weight[t, j]) * (down64[e] @ np.square(np.maximum(up64[e] @ x64[t], 0.0)))
    _check(moe_experts(x, jnp.asarray(idx), weight, up, down, impl=IMPL, tiling=tiling), ref, 8e-3,
           f"moe prefill {fmt} {rows}-row blocks vs f64")
    _check(moe_experts(x, jnp.asarray(idx), weight, up, down, impl="xla"), ref, 5e-3, f"moe prefill xla {fmt}")


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "dense"])
def test_fused_relu2_same_values(fmt, monkeypatch):
    """Tiling.fused_relu2 (the default): prefill blocks' up projection stores relu(y)^2 in the activations'
    dtype from the kernel (one split, wgmma): the same MoE output, bit for bit, as relu^2 in XLA after
    float32 products."""
    monkeypatch.setattr(_blocked, "num_sms", lambda: 1)  # the grid fills the GPU: one split
    fused = []
    gemm = _blocked.weight_gemm
    monkeypatch.setattr(_blocked, "weight_gemm", lambda *a, **k: fused.append(k["relu2"]) or gemm(*a, **k))
    rng = _rng(12)
    tokens = 40
    idx = jnp.asarray(np.stack([rng.permutation(E)[:TOPK] for _ in range(tokens)]).astype(np.int32))
    x = _x(rng, (tokens, H), jnp.bfloat16)
    weight = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, TOPK)).astype(np.float32))
    up, down = WEIGHTS[fmt](rng, (E,), F, H), WEIGHTS[fmt](rng, (E,), H, F)
    run = lambda tiling: np.asarray(moe_experts(x, idx, weight, up, down, impl=IMPL, tiling=tiling))
    plain = run(Tiling(fused_relu2=False))
    assert fused == [False, False]
    np.testing.assert_array_equal(run(Tiling()), plain)
    assert fused[2:] == [True, False]  # the up projection fused, the down one as it was


@pytest.mark.parametrize("tokens", [1, 5])  # the one-token path and the path of blocks grouped by expert
def test_moe_left_out_tokens_read_no_experts(tokens):
    """Tokens with valid False (padding, finished slots) get zero and read no expert weights: an expert
    only they select may hold NaN."""
    x, idx, weight, up, down = _moe_inputs("nvfp4", jnp.bfloat16)
    x, idx, weight = x[:tokens], jnp.asarray(EXPERT_IDX[:tokens]), weight[:tokens]
    valid = jnp.asarray([t % 2 == 1 or tokens == 1 for t in range(tokens)]) if tokens > 1 else jnp.asarray([False])
    only_left_out = [e for e in range(E) if not (np.asarray(idx)[np.asarray(valid)] == e).any()]
    poisoned_up, poisoned_down = up, down
    for e in only_left_out:
        poisoned_up, poisoned_down = _poison(poisoned_up, e), _poison(poisoned_down, e)
    y = np.asarray(moe_experts(x, idx, weight, poisoned_up, poisoned_down, valid=valid, impl=IMPL), np.float32)
    full = np.asarray(moe_experts(x, idx, weight, up, down, impl=IMPL), np.float32)
    keep = np.asarray(valid)
    assert np.isfinite(y).all() and (y[~keep] == 0).all()
    np.testing.assert_array_equal(y[keep], full[keep])
