"""Weight formats: FP8Weight and NVFP4Weight pytrees (a dense weight is a plain array).

Each format class holds its tensors in the layout the kernels stream (set once, when the weight is built
from a checkpoint's tensors with `from_hf`), converts back (`to_hf`), dequantises with plain jnp (the
reference every kernel is checked against), and decodes one streamed tile in registers inside the
kernel (`decode_tile`). Everything one format needs is in its class: adding a format touches this file.
Logical shape [..., out, in] (leading dims stack experts), as in Hugging Face checkpoints.

Formats (NVIDIA ModelOpt):
  FP8    W[o, k] = float(e4m3 data[o, k]) * scale                      (per tensor, per expert when stacked)
  NVFP4  W[o, k] = e2m1(code[o, k]) * float(e4m3 block_scale[o, k // 16]) * global_scale
         HF stores two codes a byte, element 2j in the low nibble of byte j.

Activation quantisation is a property of the weight: `input_scale` (float32 [...], ModelOpt's
".input_scale") set means the op quantises its input first, None means weight-only. With s = input_scale:
  FP8    x_q = fp8_e4m3(clip(x * (1/s), +-448)) * s                                        (W8A8)
  NVFP4  per block of 16 inputs: b = fp8_e4m3(clip(amax(|x_blk|) / (6 s), 2^-9, 448)), 1 for an all-zero
         block; x_q = e2m1_round(x / (b s)) * (b s), round to nearest, ties to even, saturating at 6  (W4A4)
NVFP4 is ModelOpt's fake quantisation in the operation order of its NVFP4QTensor, divisions IEEE-exact.
FP8 multiplies by the reciprocal scale, as serving kernels do (ModelOpt's fake quant multiplies by
448/amax: both are within an ulp of x / s). `input_codes` gives the exactly representable codes (e4m3,
or e2m1 x e4m3) with x_q = codes * s up to one rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NVFP4_BLOCK = 16  # elements sharing one NVFP4 block scale
FP8_MAX = 448.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)
_GROUP_BYTES = NVFP4_BLOCK // 2  # packed bytes per block scale
_E2M1_CUTS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))
_MIN_BLOCK_SCALE = 2.0**-9  # smallest e4m3 subnormal: activation block scales never round to zero
# e2m1 code v -> the e4m3 byte ((v & 7) << 2) | ((v & 8) << 4), whose value is e2m1(v) * 2**-6 exactly
# (e2m1's exponent and mantissa bits land in e4m3's low exponent and top mantissa bits; e2m1 zero and
# subnormals map to e4m3 zero and subnormals). Hardware then converts e4m3 pairs to float16 pairs.
E2M1_UNIT = 2.0**-6


def row_exponent(row_max):
    """e with row_max < 2**e (frexp's exponent) for row maxima >= 0, clamped to [-126, 126] so that
    2**e and 2**-e are both normal float32: zero, subnormal and non-finite maxima need no special case
    (a zero or subnormal row scales by 2**126, an inf/NaN row stays non-finite). A few integer ops on the
    float's bits, where jnp.frexp's special cases expand to ~50 HLO ops a call."""
    biased = lax.bitcast_convert_type(row_max.astype(jnp.float32), jnp.int32) >> 23
    return jnp.clip(biased - 126, -126, 126)


def pow2(e):
    """2.0**e as float32 for int32 e in [-126, 127], built from its bits (x * pow2(e) is ldexp(x, e))."""
    return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def e2m1_pair_to_f16(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 [...] of two e2m1 codes -> (low-nibble, high-nibble) values times E2M1_UNIT, exact float16.

    16-bit integer ops (Mosaic GPU refuses arithmetic on 8-bit registers), a bitcast to e4m3 and
    e4m3 -> float16 (one hardware conversion per pair on the GPU): the same code runs on arrays and on
    Mosaic GPU registers (fp4 conversions are Blackwell-only)."""
    p = packed.astype(jnp.uint16)
    lo = ((p << 2) & 0x1C) | ((p << 4) & 0x80)
    hi = ((p >> 2) & 0x1C) | (p & 0x80)
    as_f16 = lambda b: lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float16)
    return as_f16(lo), as_f16(hi)


def _f16_decode_ptx() -> dict[str, list[str]]:
    """PTX of the float16 decode, per nibble ("lo", "hi"): four codes of $1 a 32-bit op, each placed as an
    e4m3 byte whose value is e2m1 * E2M1_UNIT, then cvt.rn.f16x2.e4m3x2 a pair, into %nv_r0 (bytes 0, 1)
    and %nv_r1 (bytes 2, 3)."""
    first = {"lo": ("shl.b32 %nv_a, $1, 2;", "shl.b32 %nv_b, $1, 4;"), "hi": ("shr.b32 %nv_a, $1, 2;", "mov.b32 %nv_b, $1;")}
    return {k: [sa, "and.b32 %nv_a, %nv_a, 0x1C1C1C1C;", sb, "and.b32 %nv_b, %nv_b, 0x80808080;",
                "or.b32 %nv_a, %nv_a, %nv_b;", "mov.b32 {%nv_h0, %nv_h1}, %nv_a;",
                "cvt.rn.f16x2.e4m3x2 %nv_r0, %nv_h0;", "cvt.rn.f16x2.e4m3x2 %nv_r1, %nv_h1;"]
            for k, (sa, sb) in first.items()}


def _bf16_decode_ptx() -> dict[str, list[str]]:
    """PTX of the bfloat16 decode, per nibble: each code's sign, exponent and mantissa bits placed straight
    into a bfloat16, the value e2m1 * 2**-126 (e2m1 zero and 0.5 land on bfloat16 zero and its subnormal
    2**-127). Bytes 0, 1 of $1 spread to bytes 0, 2 of a word with one prmt (bytes 2, 3 likewise); then
    per bf16x2 pair the nibbles are masked out, one multiply places two copies of each (the magnitude bits
    0-2 at bits 6-8, the sign bit 3 at bit 15, of each half; the copies never overlap, so nothing carries)
    and a mask keeps those bits: three instructions a pair (one integer multiply-add), into %nv_r0 and
    %nv_r1."""
    spread = ["mov.b32 %nv_b, 0;", "prmt.b32 %nv_u, $1, %nv_b, 0x4140;", "prmt.b32 %nv_w, $1, %nv_b, 0x4342;"]
    # code bits 0-3 (lo) copied up by 6 and 12, bits 4-7 (hi) by 2 and 8: magnitude to 6-8, sign to 15
    placements = {"lo": ("0x000F000F", (1 << 6) + (1 << 12)), "hi": ("0x00F000F0", (1 << 2) + (1 << 8))}
    programs = {}
    for k, (nibbles, copies) in placements.items():
        body = list(spread)
        for src, dst in (("%nv_u", "%nv_r0"), ("%nv_w", "%nv_r1")):
            body += [f"and.b32 %nv_a, {src}, {nibbles};", f"mul.lo.u32 %nv_a, %nv_a, {copies:#x};",
                     f"and.b32 {dst}, %nv_a, 0x81C081C0;"]
        programs[k] = body
    return programs


DECODE_PTX = {jnp.dtype(jnp.float16): _f16_decode_ptx(), jnp.dtype(jnp.bfloat16): _bf16_decode_ptx()}


def _word_decoder(dtype):
    """decode(word) for MLIR i32 values of four codes (GPU kernels only): {"lo": ..., "hi": ...}, each the
    DECODE_PTX program's (bytes 0, 1) and (bytes 2, 3) value pairs as vector<2 x dtype> registers."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.extend.mlir import ir
    from jaxlib.mlir.dialects import llvm

    ptx = {k: "\n".join(["{", ".reg .b32 %nv_a, %nv_b, %nv_u, %nv_w, %nv_r0, %nv_r1;", ".reg .b16 %nv_h0, %nv_h1;",
                         *body, "mov.b64 $0, {%nv_r0, %nv_r1};", "}"])
           for k, body in DECODE_PTX[jnp.dtype(dtype)].items()}

    def decode(word):
        i64 = ir.IntegerType.get_signless(64)
        x4 = ir.VectorType.get((4,), ir.F16Type.get() if dtype == jnp.float16 else ir.BF16Type.get())
        out = {}
        for k, asm in ptx.items():
            res = mgpu.utils.bitcast(llvm.inline_asm(i64, [word], asm, "=l,r"), x4)
            out[k] = (mgpu.utils.vector_slice(res, slice(0, 2)), mgpu.utils.vector_slice(res, slice(2, 4)))
        return out

    return decode


def _ptx_decode(codes: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """uint8 codes on Mosaic GPU registers -> their (low-nibble, high-nibble) values in dtype: DECODE_PTX's
    programs run on every pair of WGMMA-layout registers (a 32-bit word $1 of four codes), the results in
    codes' layout. GPU only (the interpreter has no PTX; e2m1_pair_to_f16 is the float16 decode's model)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.extend.mlir import ir
    from jax.experimental.pallas import mosaic_gpu as plgpu

    decode_word = _word_decoder(dtype)
    out_ty = plgpu.ShapeDtypeStruct(codes.shape, dtype, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=(out_ty, out_ty))
    def decode(_, c):
        i32 = ir.IntegerType.get_signless(32)
        regs = list(c.registers.flat)
        if len(regs) % 2:
            raise ValueError(f"PTX e2m1 decode pairs registers: got {len(regs)} for shape {c.shape}")
        outs = {"lo": [], "hi": []}
        for i in range(0, len(regs), 2):
            pair = mgpu.utils.vector_concat(regs[i:i + 2])  # vector<4xi8>
            for k, values in decode_word(mgpu.utils.bitcast(pair, i32)).items():
                outs[k] += values

        def array(registers):
            grid = np.empty(len(registers), dtype=object)
            grid[:] = registers
            return mgpu.FragmentedArray(_registers=grid.reshape(c.registers.shape), _layout=c.layout,
                                        _is_signed=None)

        return array(outs["lo"]), array(outs["hi"])

    return decode(codes)


def mma_operand_register(tile: int, half: int, rh: int, h: int, nibble: int | None = None) -> tuple[int, ...]:
    """Where a decoded value pair goes in warp-level mma's A operand: from the 8-bit codes register
    [0, tile, 0, half, rh] of MMA_LHS(uint8) (row 16 warp + 8 rh + lane // 4, bytes 32 tile + 16 half +
    4 (lane % 4) .. + 3), the pair h (bytes 2h, 2h + 1; of their low (nibble 0) or high (1) nibbles for
    packed 4-bit codes) -> the index of the bfloat16 MMA_LHS register [0, f, 0, h, rh] (the same row,
    columns 16 f + 8 h + 2 (lane % 4) + {0, 1}). A 16-byte chunk fills one 16-column tile with 8-bit
    codes, two with 4-bit ones."""
    chunk = 2 * tile + half
    return (0, chunk if nibble is None else 2 * chunk + nibble, 0, h, rh, 0, 0, 0, 0)


def _mma_operand(values: jax.Array) -> jax.Array:
    """values [64, 16c] bfloat16 in MMA_LHS(uint8)'s layout (what converting 8-bit codes loaded in it
    gives: four adjacent columns of a row a thread) -> warp-level mma's bfloat16 A operand (MMA_LHS),
    K in FP8Weight.mma_k_order: each thread's value pairs relabelled, none moved. GPU only."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from pallas_kernels._wgemm import relabel_registers

    where = lambda index, h: mma_operand_register(index[1], index[3], index[4], h)  # (0, tile, 0, half, rh, ...)
    return relabel_registers(values, plgpu.Layout.MMA_LHS(jnp.uint8), plgpu.Layout.MMA_LHS(jnp.bfloat16), 2, where)


def mma_rhs_register(chunk: int, h: int) -> tuple[int, ...]:
    """Where an activation pair goes in warp-level mma's bfloat16 B operand ([tk, 8], MMA_RHS): the h-th
    pair (elements 2h, 2h + 1) of the chunk-th 4-element register of an activation tile loaded in its
    format's mma_x_layout -> the index of the MMA_RHS register [f, 0, h, ...] of 16-row tile f = chunk
    (rows 16 f + 8 h + 2 (lane % 4) + {0, 1}, column lane // 4)."""
    return (chunk, 0, h, 0, 0, 0, 0, 0)


def _load_mma_rhs(x_t, layout, optimized: bool) -> jax.Array:
    """x_t [tk, 8] bfloat16 (an SMEM activation tile, transposed) -> warp-level mma's B operand
    (MMA_RHS(bfloat16)), K in the order of `layout`: loaded with four adjacent activations of a row a
    thread (`layout`, a format's mma_x_layout), each register's two pairs relabelled, none moved.
    optimized: Mosaic's bank-conflict-free load plan (two lane groups in staggered order, registers put
    back with selects), else the plain one (two lanes of a 16-lane wavefront may share a bank). GPU only."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from pallas_kernels._wgemm import relabel_registers

    registers = layout.to_mgpu().registers_shape(x_t.shape)  # in K order: 16 activations of a row each
    where = lambda index, h: mma_rhs_register(int(np.ravel_multi_index(index, registers)), h)
    return relabel_registers(plgpu.load(x_t, layout=layout, optimized=optimized), layout,
                             plgpu.Layout.MMA_RHS(jnp.bfloat16), 2, where)


def _ptx_decode_mma(codes: jax.Array, scales: list[jax.Array]) -> jax.Array:
    """codes [64, 16c] uint8 in MMA_LHS(uint8) layout (m16n8k32's 8-bit A operand: a thread holds four
    adjacent bytes of a row, all of one 8-byte NVFP4 block), scales: bfloat16 block scales, either 2c rows
    [64] (_wgemm.ROW_LAYOUT, one per block) or c pairs [2, 64] (NVFP4Weight.mma_scale_layout, one per
    16-byte chunk) -> the [64, 32c] bfloat16 A operand of warp-level mma (m16n8k16, MMA_LHS layout), its
    K order NVFP4Weight.mma_k_order's: each register's word decodes (DECODE_PTX) into the four value pairs
    a thread holds of two 16-column operand tiles, so no value moves between threads. Lanes 0-1 of a
    row's four read the chunk's first block, lanes 2-3 its second: from rows the scale is picked per lane,
    a pair holds each lane's own. GPU only."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.extend.mlir import ir
    from jaxlib.mlir.dialects import arith
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from pallas_kernels._wgemm import ROW_LAYOUT

    decode_word = _word_decoder(jnp.bfloat16)
    out_ty = plgpu.ShapeDtypeStruct((codes.shape[0], 2 * codes.shape[1]), jnp.bfloat16,
                                    layout=plgpu.Layout.MMA_LHS(jnp.bfloat16))

    paired = scales[0].ndim == 2
    scale_layout = NVFP4Weight.mma_scale_layout() if paired else ROW_LAYOUT

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.MMA_LHS(jnp.uint8), *[scale_layout] * len(scales)), return_type=out_ty)
    def decode(_, c, *rows):
        i32 = ir.IntegerType.get_signless(32)
        if not paired:  # lanes 2-3 of a row's four take the chunk's second block
            lane = arith.remui(mgpu.utils.thread_idx(), mgpu.utils.c(32, i32))
            second = arith.cmpi(arith.CmpIPredicate.uge, arith.remui(lane, mgpu.utils.c(4, i32)), mgpu.utils.c(2, i32))
        layout = mgpu.MMALayouts(jnp.bfloat16, m_warps=4).lhs
        out = np.empty(layout.registers_shape(out_ty.shape), dtype=object)
        for (_, tile, _, half, rh, *_), word in np.ndenumerate(c.registers):
            chunk = 2 * tile + half
            if paired:  # registers (..., rh, ...): this lane's block of the chunk, rows 8 rh + lane // 4
                scale = rows[chunk].registers.flat[rh]
            else:
                first_s, second_s = rows[2 * chunk].registers.flat[rh], rows[2 * chunk + 1].registers.flat[rh]
                scale = arith.select(second, second_s, first_s)
            scale = mgpu.utils.vector_concat([scale, scale])
            decoded = decode_word(mgpu.utils.bitcast(word, i32))
            for nibble, k in enumerate(("lo", "hi")):
                for h, pair in enumerate(decoded[k]):
                    out[mma_operand_register(tile, half, rh, h, nibble)] = arith.mulf(pair, scale)
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)

    return decode(codes, *scales)


def e2m1_round(a: jax.Array) -> jax.Array:
    """Magnitudes a >= 0 -> the nearest e2m1 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even
    code, above 6 -> 6. Each cut is a midpoint; a tie stays down where the lower code is even."""
    out = jnp.zeros_like(a)
    for (cut, tie_down), value in zip(_E2M1_CUTS, E2M1_VALUES[1:8]):
        out = jnp.where((a > cut) if tie_down else (a >= cut), value, out)
    return out


def _exact_div(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b with IEEE division everywhere: XLA rewrites a / broadcast(b) into a * broadcast(1 / b), which
    moves rounding boundaries, so the divisor is materialised at a's shape behind a barrier."""
    return a / lax.optimization_barrier(jnp.broadcast_to(b, jnp.broadcast_shapes(a.shape, b.shape)))


def _scale_for(x: jax.Array, input_scale, extra: int) -> jax.Array:
    """input_scale (scalar or broadcastable to x[..., 0]) as float32 with `extra` trailing unit axes."""
    return jnp.asarray(input_scale, jnp.float32).reshape(jnp.shape(input_scale) + (1,) * extra)


def _nvfp4_input_parts(x: jax.Array, input_scale) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., K] -> (signed e2m1 values [..., K/16, 16], block scales b (e4m3 values) [..., K/16, 1],
    s [..., 1, 1]) of ModelOpt's NVFP4 activation quantisation (module docstring)."""
    *lead, k = x.shape
    blocks = x.astype(jnp.float32).reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK)
    s = _scale_for(x, input_scale, 2)
    b = _exact_div(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), 6.0 * s)
    b = jnp.clip(jnp.where(b == 0, 1.0, b), _MIN_BLOCK_SCALE, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    mag = e2m1_round(jnp.abs(_exact_div(blocks, b * s)))
    return jnp.where(blocks < 0, -mag, mag), b, s


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Weight:
    """Per-tensor FP8 (e4m3fn) weight: W = float(data) * scale.

    data: float8_e4m3fn [..., out, in] (streamed as is); scale: float32 [...]; input_scale: float32 [...]
    (W8A8: inputs quantised to e4m3 with it) or None (weight-only).
    """

    data: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None = None

    K_PER_ELEMENT: ClassVar[int] = 1  # logical K elements per streamed weight element
    ELEMENTS_PER_SCALE_ROW: ClassVar[int | None] = None  # streamed weight elements per block-scale row (none)
    # the logical dims each stored leaf's dims hold ("*": the leading dims of [..., out, in]), so a
    # sharding of the logical weight carries over to its leaves
    LEAF_DIMS: ClassVar[dict[str, tuple[str, ...]]] = {"data": ("*", "out", "in"), "scale": ("*",),
                                                       "input_scale": ("*",)}

    @classmethod
    def from_hf(cls, data, scale, input_scale=None) -> "FP8Weight":
        """From ModelOpt tensors: weight float8_e4m3fn [..., out, in], weight_scale float32 [...],
        optional input_scale float32 [...]."""
        return cls(jnp.asarray(data), jnp.asarray(scale, jnp.float32), _optional_f32(input_scale))

    def to_hf(self) -> dict[str, jax.Array]:
        return _with_input_scale({"weight": self.data, "weight_scale": self.scale}, self.input_scale)

    @staticmethod
    def input_codes(x: jax.Array, input_scale) -> jax.Array:
        """x [..., K] -> float8_e4m3fn codes fp8(clip(x * (1/s), +-448)) [..., K]; s broadcastable to x[..., 0]."""
        return jnp.clip(x.astype(jnp.float32) * (1.0 / _scale_for(x, input_scale, 1)), -FP8_MAX, FP8_MAX
                        ).astype(jnp.float8_e4m3fn)

    @classmethod
    def fake_quantize_input(cls, x: jax.Array, input_scale) -> jax.Array:
        """x [..., K] -> float32 quantised activations codes * s (the W8A8 input)."""
        return cls.input_codes(x, input_scale).astype(jnp.float32) * _scale_for(x, input_scale, 1)

    def fold_input_scale(self) -> "FP8Weight":
        """The weight-only weight that, applied to `input_codes`, gives the W8A8 product (scale * input_scale)."""
        return FP8Weight(self.data, self.scale * self.input_scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.data.astype(jnp.float32) * self.scale.astype(jnp.float32)[..., None, None]).astype(dtype)

    def stream(self) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """(weight [..., out, in], block scales or None, per-tensor output scale [...])."""
        return self.data, None, self.scale

    @staticmethod
    def operand_unit(dtype) -> float:
        """decode_tile's operand is W / scale times this (exact e4m3 values in either MMA dtype)."""
        return 1.0

    @staticmethod
    def decode_tile(codes: jax.Array, scale_rows: list[jax.Array], ptx: bool, dtype=jnp.float16) -> jax.Array:
        """codes [64, tk] e4m3 -> the exact [64, tk] MMA operand in dtype (float16: one hardware conversion
        a pair; bfloat16: through float16)."""
        f16 = codes.astype(jnp.float16)
        return f16 if dtype == jnp.float16 else f16.astype(dtype)

    MMA_K_CHUNK: ClassVar[int] = 16  # weight values mma_k_order permutes within

    @staticmethod
    def mma_k_order(x: jax.Array) -> jax.Array:
        """x [..., K] (K % MMA_K_CHUNK == 0) in the K order both warp-level mma operands hold (decode_mma_tile's
        weight, load_mma_x's activations): within each chunk of 16, position 8h + 4t1 + 2t0 + e takes
        element 8t1 + 4t0 + 2h + e (a reshape and a transpose; the tests' statement of the order)."""
        *lead, k = x.shape
        chunks = x.reshape(*lead, k // FP8Weight.MMA_K_CHUNK, 2, 2, 2, 2)  # (t1, t0, h, e)
        n = len(lead) + 1
        return chunks.transpose(*range(n), n + 2, n, n + 1, n + 3).reshape(x.shape)

    @staticmethod
    def decode_mma_tile(codes: jax.Array, scale_rows: list[jax.Array]) -> jax.Array:
        """codes [64, tk] e4m3 in MMA_LHS(uint8) layout (tk % 32 == 0), no scale rows -> the [64, tk]
        bfloat16 A operand of warp-level mma, K in mma_k_order, values as decode_tile's. GPU only."""
        return _mma_operand(codes.astype(jnp.float16).astype(jnp.bfloat16))

    @staticmethod
    def mma_x_layout():
        """Register layout of a [tk, 8] activation tile whose loads hold x in mma_k_order: a thread the
        four activations 4t..4t+3 of each 16 (t = lane % 4, column lane // 4), as MMA_RHS(uint8) lays out
        8-bit values."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.Layout.MMA_RHS(jnp.uint8)

    @staticmethod
    def load_mma_x(x_t, optimized: bool = True) -> jax.Array:
        """x_t [tk, 8] bfloat16 activation tile in SMEM (transposed) -> warp-level mma's B operand, K in
        mma_k_order (no permuted copy of x); optimized: Mosaic's staggered, bank-conflict-free load plan, else
        the plain one (_load_mma_rhs). GPU only."""
        return _load_mma_rhs(x_t, FP8Weight.mma_x_layout(), optimized)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    """NVFP4 weight in kernel layout.

    packed: uint8 [..., out, in/2], group-split nibbles: in each block of 16 elements (8 bytes), byte j
      holds element j in its low nibble and element 8 + j in its high nibble, so a tile's low and high
      nibbles decode to contiguous 8-column chunks of W (no interleaving of the activations is needed).
    scale: float8_e4m3fn [..., in/16, out], the block scales transposed, so the scales of a K step are a
      contiguous box the TMA engine streams with the codes.
    global_scale: float32 [...].
    input_scale: float32 [...] (W4A4: inputs quantised to NVFP4 with it as their global scale) or None.
    """

    packed: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    input_scale: jax.Array | None = None

    K_PER_ELEMENT: ClassVar[int] = 2
    ELEMENTS_PER_SCALE_ROW: ClassVar[int | None] = _GROUP_BYTES
    MMA_K_CHUNK: ClassVar[int] = 32  # weight values (16 code bytes, two blocks) mma_k_order permutes within
    # packed's in dim holds in/2 bytes, scale's (transposed) in dim in/16 blocks
    LEAF_DIMS: ClassVar[dict[str, tuple[str, ...]]] = {"packed": ("*", "out", "in"), "scale": ("*", "in", "out"),
                                                       "global_scale": ("*",), "input_scale": ("*",)}

    @classmethod
    def from_hf(cls, packed, block_scale, global_scale, input_scale=None) -> "NVFP4Weight":
        """From ModelOpt tensors: weight uint8 [..., out, in/2] (element 2j low nibble of byte j),
        weight_scale float8_e4m3fn [..., out, in/16], weight_scale_2 float32 [...], optional input_scale."""
        packed = _regroup_nibbles(jnp.asarray(packed), to_kernel=True)
        return cls(packed, jnp.swapaxes(jnp.asarray(block_scale), -1, -2), jnp.asarray(global_scale, jnp.float32),
                   _optional_f32(input_scale))

    def to_hf(self) -> dict[str, jax.Array]:
        return _with_input_scale({"weight": _regroup_nibbles(self.packed, to_kernel=False),
                                  "weight_scale": jnp.swapaxes(self.scale, -1, -2),
                                  "weight_scale_2": self.global_scale}, self.input_scale)

    @staticmethod
    def input_codes(x: jax.Array, input_scale) -> jax.Array:
        """x [..., K] -> float32 codes e2m1 * b [..., K] (exact: at most 6 significant bits, multiples of
        2^-10 below 2688), the quantised activations being codes * s."""
        q, b, _ = _nvfp4_input_parts(x, input_scale)
        return (q * b).reshape(x.shape)

    @staticmethod
    def fake_quantize_input(x: jax.Array, input_scale) -> jax.Array:
        """x [..., K] -> float32 quantised activations e2m1 * (b * s) (the W4A4 input, ModelOpt's rounding)."""
        q, b, s = _nvfp4_input_parts(x, input_scale)
        return (q * (b * s)).reshape(x.shape)

    def fold_input_scale(self) -> "NVFP4Weight":
        """The weight-only weight that, applied to `input_codes`, gives the W4A4 product
        (global_scale * input_scale)."""
        return NVFP4Weight(self.packed, self.scale, self.global_scale * self.input_scale)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, half = self.packed.shape
        return (*lead, out, 2 * half)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        *lead, out, half = self.packed.shape
        lo, hi = e2m1_pair_to_f16(self.packed.reshape(*lead, out, half // _GROUP_BYTES, _GROUP_BYTES))
        values = jnp.concatenate([lo, hi], axis=-1).astype(jnp.float32) / E2M1_UNIT  # [..., out, groups, 16]
        scales = jnp.swapaxes(self.scale, -1, -2).astype(jnp.float32)[..., None]
        glob = self.global_scale.astype(jnp.float32)[..., None, None, None]
        return (values * scales * glob).reshape(*lead, out, 2 * half).astype(dtype)

    def stream(self) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """(packed codes, block scales, per-tensor output scale); the kernel's caller also divides the
        output by operand_unit."""
        return self.packed, self.scale, self.global_scale

    @staticmethod
    def operand_unit(dtype) -> float:
        """decode_tile's operand is W / global_scale times this: E2M1_UNIT in float16 (no multiply per block
        scale in the kernel; one on the f32 output instead), E2M1_UNIT / 2 in bfloat16."""
        return E2M1_UNIT if dtype == jnp.float16 else E2M1_UNIT / 2

    @staticmethod
    def decode_tile(codes: jax.Array, scale_rows: list[jax.Array], ptx: bool, dtype=jnp.float16) -> jax.Array:
        """codes [64, 8g] uint8 (g blocks), scale_rows: g per-row e4m3 block scales [64] -> the
        [64, 16g] MMA operand in dtype: W's values (before the global scale) times operand_unit(dtype),
        exact (float16: at least 2**-16, at most 6 significant bits, which float16 subnormals hold;
        bfloat16: all normal). ptx: decode in hand-written PTX (GPU only).

        Block c's low nibbles are W columns 16c..16c+7 and its high nibbles 16c+8..16c+15; concatenating
        8-column chunks keeps Mosaic's register layout (8 columns is one WGMMA layout tile).
        bfloat16 in PTX: codes placed as bfloat16 bits (times 2**-126, 0.5 a bfloat16 subnormal) times
        the block scale times operand_unit * 2**126 (2**119: finite for every e4m3 scale); without PTX: the
        float16 operand, converted and rescaled to operand_unit (the same values)."""
        rows = codes.shape[0]
        unit = NVFP4Weight.operand_unit(dtype)
        if dtype == jnp.bfloat16 and ptx:
            lo, hi = _ptx_decode(codes, jnp.bfloat16)
            as_scale = NVFP4Weight._bf16_ptx_scale
        else:
            lo, hi = _ptx_decode(codes, jnp.float16) if ptx else e2m1_pair_to_f16(codes)
            as_scale = lambda s: s.astype(jnp.float16)
        chunks = []
        for c, s in enumerate(scale_rows):
            s = lax.broadcast_in_dim(as_scale(s), (rows, _GROUP_BYTES), (0,))
            cols = slice(c * _GROUP_BYTES, (c + 1) * _GROUP_BYTES)
            chunks += [lo[:, cols] * s, hi[:, cols] * s]
        operand = jnp.concatenate(chunks, axis=1)
        if operand.dtype == dtype:
            return operand
        return operand.astype(dtype) * jnp.asarray(unit / E2M1_UNIT, dtype)

    @staticmethod
    def mma_k_order(x: jax.Array) -> jax.Array:
        """x [..., K] (K % MMA_K_CHUNK == 0) in the K order both warp-level mma operands hold (decode_mma_tile's
        weight, load_mma_x's activations): within each chunk of 32, position 16s + 8h + 4t1 + 2t0 + e
        takes element 16t1 + 8s + 4t0 + 2h + e (five index bits permuted: a reshape and a transpose; the
        tests' statement of the order). A product over K is the same in either order."""
        *lead, k = x.shape
        chunks = x.reshape(*lead, k // NVFP4Weight.MMA_K_CHUNK, 2, 2, 2, 2, 2)  # (t1, s, t0, h, e)
        n = len(lead) + 1
        return chunks.transpose(*range(n), n + 1, n + 3, n, n + 2, n + 4).reshape(x.shape)

    @staticmethod
    def decode_mma_tile(codes: jax.Array, scale_rows: list[jax.Array]) -> jax.Array:
        """codes [64, 8g] uint8 in MMA_LHS(uint8) layout (g even), scale_rows: g e4m3 block scales [64], or
        g/2 pairs of them [2, 64] in mma_scale_layout -> the [64, 16g] bfloat16 A operand of warp-level
        mma, K in mma_k_order, values as decode_tile's bfloat16 operand (times operand_unit(bfloat16)).
        GPU only (PTX)."""
        return _ptx_decode_mma(codes, [NVFP4Weight._bf16_ptx_scale(r) for r in scale_rows])

    @staticmethod
    def mma_scale_layout():
        """Register layout of a [2, 64] pair of block-scale rows, the two blocks of one 16-byte chunk of
        decode_mma_tile's codes: each thread holds, for its two rows of the warp's 16 (16 warp + 8 rh +
        lane // 4; register rh), the scale of the block its code words come from (lanes 0-1 of a row's
        four: the first, 2-3: the second; lane = 4 (lane // 4) + 2 block + copy), one value a register."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.Layout.TILED(plgpu.Tiling(((2, 64), (2, 16), (2, 8), (1,))), warp_dims=(-6,),
                                  lane_dims=(-2, -3, plgpu.Replicated(2)), vector_dim=-1)

    @staticmethod
    def mma_x_layout():
        """Register layout of a [tk, 8] activation tile whose loads hold x in mma_k_order: within each 32,
        a thread (t = 2 t1 + t0 = lane % 4, column lane // 4) holds 16 t1 + 8 s + 4 t0 + {0..3} for s = 0, 1
        (tiles of 32, then 16 (t1), 8 (s) and 4 (t0) rows; the lane is column, t1, t0)."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.Layout.TILED(plgpu.Tiling(((32, 8), (16, 8), (8, 1), (4, 1))),
                                  warp_dims=(plgpu.Replicated(4),), lane_dims=(-5, -8, -4), vector_dim=-2)

    @staticmethod
    def load_mma_x(x_t, optimized: bool = True) -> jax.Array:
        """x_t [tk, 8] bfloat16 activation tile in SMEM (transposed) -> warp-level mma's B operand, K in
        mma_k_order (no permuted copy of x); optimized: Mosaic's staggered, bank-conflict-free load plan, else
        the plain one (_load_mma_rhs). GPU only."""
        return _load_mma_rhs(x_t, NVFP4Weight.mma_x_layout(), optimized)

    @staticmethod
    def _bf16_ptx_scale(scale_row: jax.Array) -> jax.Array:
        """e4m3 block scales -> the bfloat16 factor of the bfloat16 PTX decode's codes (e2m1 * 2**-126):
        scale * operand_unit(bfloat16) * 2**126, exact (finite for every e4m3 scale)."""
        unit = NVFP4Weight.operand_unit(jnp.bfloat16)
        return (scale_row.astype(jnp.float16).astype(jnp.float32) * (unit * 2.0**126)).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames="to_kernel")
def _regroup_nibbles(packed: jax.Array, to_kernel: bool) -> jax.Array:
    """Convert packed codes between the HF nibble order (element 2j, 2j+1 in byte j) and the kernel's
    group-split order (elements j, 8 + j of each 16-element block in byte j of the block). Jitted: a
    checkpoint converts thousands of expert weights, one fused dispatch each instead of ten eager ops."""
    *lead, out, half = packed.shape
    if half % _GROUP_BYTES:
        raise ValueError(f"NVFP4 weight with {2 * half} input columns: must be a multiple of {NVFP4_BLOCK}")
    blocks = packed.reshape(*lead, out, half // _GROUP_BYTES, _GROUP_BYTES)
    lo, hi = blocks & 0xF, blocks >> 4
    if to_kernel:  # HF elements: e[2j] = lo[j], e[2j+1] = hi[j]; kernel byte j = e[j] | e[8 + j] << 4
        elems = jnp.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], NVFP4_BLOCK)
        new_lo, new_hi = elems[..., :_GROUP_BYTES], elems[..., _GROUP_BYTES:]
    else:  # kernel elements: e[j] = lo[j], e[8 + j] = hi[j]; HF byte j = e[2j] | e[2j+1] << 4
        elems = jnp.concatenate([lo, hi], axis=-1)
        new_lo, new_hi = elems[..., 0::2], elems[..., 1::2]
    return (new_lo | (new_hi << 4)).astype(jnp.uint8).reshape(packed.shape)


def _optional_f32(a) -> jax.Array | None:
    return None if a is None else jnp.asarray(a, jnp.float32)


def _with_input_scale(tensors: dict[str, jax.Array], input_scale) -> dict[str, jax.Array]:
    return tensors if input_scale is None else {**tensors, "input_scale": input_scale}


QuantizedWeight = Union[FP8Weight, NVFP4Weight]
Weight = Union[jax.Array, FP8Weight, NVFP4Weight]


def is_quantized(w) -> bool:
    """Whether w is a format object (FP8Weight, NVFP4Weight, or any class with their kernel interface:
    decode_tile, stream, K_PER_ELEMENT, ...), not a plain array."""
    return hasattr(type(w), "decode_tile")


def dequantize(w: Weight, dtype=jnp.float32) -> jax.Array:
    """Reference dequantisation of any weight to a dense [..., out, in] array of `dtype`."""
    return w.dequantize(dtype) if is_quantized(w) else jnp.asarray(w).astype(dtype)
