"""Candidate NVFP4 kernel data path, to be timed against NVFP4Weight's before it replaces it.

NVFP4Weight's decode loads each thread's codes as two-byte pieces (16 shared-memory loads a K step
of 128 values, then ~56 instructions to reassemble words) and converts all 16 of its block scales a
step (the PTX of run 19 in docs/BENCHMARKS.md). Here the same packed bytes stream as 32-bit words, so
a thread's 16 code bytes of a 32-byte chunk arrive in two loads, and they all belong to one block:
thread q (lane % 4) of the wgmma layout holds words 2q and 2q+1 of each 8-word (32-byte, 4-block)
chunk, i.e. block q's 8 bytes. Decoding a word as the hardware pairs it yields the wgmma operand's
columns in another K order than W's; the activations are permuted to that order instead (a reshape
and transpose that XLA fuses into the activation preparation), so no weight is re-laid out. Each
thread then needs one block scale per chunk and row: picked by lane with one `prmt` and converted as
a pair, instead of a conversion per block.

Decoded order within a 64-value chunk (W's element 16q + e of block q, e in 0..15, lo nibble e < 8):
the operand's column n = 8X + 2q + j holds element 16q + 8 nib + 4 odd + 2 half + j, X = 4 odd + 2 nib
+ half: word 2q + odd, its bytes 2 half + j, nibble nib. So x_perm[n] = x[16q + ...]: x reshaped
[..., q, nib, odd, half, j] and transposed to [..., odd, nib, half, q, j].

Used by benchmarks/kernels.py (format "nvfp4w"), benchmarks/decode.py --nvfp4-words (gated decode
with every weight-only NVFP4 projection on this path: `on_words`) and tests/test_nvfp4_words.py; the
library's loader builds NVFP4Weight.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.formats import E2M1_UNIT, NVFP4Weight, e2m1_pair_to_f16, is_quantized

_CHUNK_WORDS = 8  # one 32-byte chunk: 4 blocks, one per thread of a wgmma quad


def _lane_split(words: jax.Array, half: int, nibble: str, odd: int) -> jax.Array:
    """jnp model of what the PTX computes for one output array X (see module docstring):
    words [64, 8c] uint32 -> float16 [64, 8c], X[:, 8t + 2q + j] = nibble of byte 2 half + j of word
    8t + 2q + odd, times E2M1_UNIT."""
    rows, width = words.shape
    src = words.reshape(rows, width // 2, 2)[:, :, odd]  # word 2q + odd of each pair
    bytes_ = jnp.stack([(src >> (8 * (2 * half + j))) & 0xFF for j in (0, 1)], axis=-1).astype(jnp.uint8)
    lo, hi = e2m1_pair_to_f16(bytes_)
    return (lo if nibble == "lo" else hi).reshape(rows, width)


def _ptx_decode(words, scales):
    """The PTX path on Mosaic GPU registers: words [64, 8] uint32 (one chunk), scales: its 4 blocks'
    e4m3 scales broadcast to [64, 8] uint8 -> 8 float16 [64, 8] arrays (A..H of the module docstring),
    each times its thread's block scale. GPU only."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.pallas import mosaic_gpu as plgpu

    decode_word = lambda w, o: [  # 4 f16x2 of word w: (lo b0 b1), (lo b2 b3), (hi b0 b1), (hi b2 b3), scaled
        f"shl.b32 %a, {w}, 2;", "and.b32 %a, %a, 0x1C1C1C1C;", f"shl.b32 %b, {w}, 4;", "and.b32 %b, %b, 0x80808080;",
        "or.b32 %a, %a, %b;", "mov.b32 {%h0, %h1}, %a;", "cvt.rn.f16x2.e4m3x2 %c, %h0;", f"mul.f16x2 ${o}, %c, %s;",
        "cvt.rn.f16x2.e4m3x2 %c, %h1;", f"mul.f16x2 ${o + 1}, %c, %s;",
        f"shr.b32 %a, {w}, 2;", "and.b32 %a, %a, 0x1C1C1C1C;", f"and.b32 %b, {w}, 0x80808080;",
        "or.b32 %a, %a, %b;", "mov.b32 {%h0, %h1}, %a;", "cvt.rn.f16x2.e4m3x2 %c, %h0;", f"mul.f16x2 ${o + 2}, %c, %s;",
        "cvt.rn.f16x2.e4m3x2 %c, %h1;", f"mul.f16x2 ${o + 3}, %c, %s;"]
    # operands: $0..$7 the outputs A, B, C, D (word 2q) and E, F, G, H (word 2q + 1); $8, $9 the words;
    # $10..$13 the four blocks' scale pairs (s, s) as 16-bit values
    asm = "\n".join([
        "{", ".reg .b32 %a, %b, %c, %q, %sel, %t01, %t23, %s4, %s;", ".reg .b16 %h0, %h1, %sh, %sx;",
        "mov.u32 %q, %laneid;", "and.b32 %q, %q, 3;", "mul.lo.u32 %sel, %q, 17;",  # byte q into bytes 0 and 1
        "mov.b32 %t01, {$10, $11};", "mov.b32 %t23, {$12, $13};", "prmt.b32 %s4, %t01, %t23, 0x6420;",
        "prmt.b32 %s, %s4, %s4, %sel;", "mov.b32 {%sh, %sx}, %s;", "cvt.rn.f16x2.e4m3x2 %s, %sh;",
        *decode_word("$8", 0), *decode_word("$9", 4), "}"])
    out_ty = plgpu.ShapeDtypeStruct(words.shape, jnp.float16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 5, return_type=(out_ty,) * 8)
    def decode(_, w, *s):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        outs = [[] for _ in range(8)]
        for pos in np.ndindex(w.registers.shape):
            word = w.registers[pos]  # vector<2xi32>: words 2q, 2q+1
            args = [mgpu.utils.vector_slice(word, slice(k, k + 1)) for k in (0, 1)]
            args = [mgpu.utils.bitcast(a, i32) for a in args]
            args += [mgpu.utils.bitcast(sk.registers[pos], i16) for sk in s]  # vector<2xi8> (s, s)
            struct = ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * 8) + ")>")
            res = llvm.inline_asm(struct, args, asm, "=r," * 8 + "r,r,h,h,h,h")
            for k in range(8):
                outs[k].append(mgpu.utils.bitcast(llvm.extractvalue(i32, res, [k]), f16x2))

        def array(registers):
            grid = np.empty(len(registers), dtype=object)
            grid[:] = registers
            return mgpu.FragmentedArray(_registers=grid.reshape(w.registers.shape), _layout=w.layout, _is_signed=None)

        return tuple(array(r) for r in outs)

    return decode(words, *scales)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4WordsWeight:
    """NVFP4Weight's tensors with the packed codes viewed as little-endian 32-bit words.

    packed: uint32 [..., out, in/8]; scale: float8_e4m3fn [..., in/16, out] (NVFP4Weight's transposed
    block scales); global_scale: float32 [...]."""

    packed: jax.Array
    scale: jax.Array
    global_scale: jax.Array

    K_PER_ELEMENT: ClassVar[int] = 8
    ELEMENTS_PER_SCALE_ROW: ClassVar[int | None] = 2

    @classmethod
    def from_nvfp4(cls, w: NVFP4Weight) -> "NVFP4WordsWeight":
        if w.input_scale is not None:
            raise ValueError("the candidate covers weight-only NVFP4")
        *lead, out, half = w.packed.shape
        words = lax.bitcast_convert_type(w.packed.reshape(*lead, out, half // 4, 4), jnp.uint32)
        return cls(words, w.scale, w.global_scale)

    def as_nvfp4(self) -> NVFP4Weight:
        *lead, out, words = self.packed.shape
        packed = lax.bitcast_convert_type(self.packed, jnp.uint8).reshape(*lead, out, 4 * words)
        return NVFP4Weight(packed, self.scale, self.global_scale)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, words = self.packed.shape
        return (*lead, out, 8 * words)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.as_nvfp4().dequantize(dtype)

    def stream(self):
        return self.packed, self.scale, self.global_scale / E2M1_UNIT

    @staticmethod
    def permute_activations(x: jax.Array) -> jax.Array:
        """x [..., K] (K a multiple of 64) in W's order -> the decoded operand's K order."""
        *lead, k = x.shape
        parts = x.reshape(*lead, k // 64, 4, 2, 2, 2, 2)  # q, nib, odd, half, j
        n = len(lead) + 1
        return parts.transpose(*range(n), n + 2, n + 1, n + 3, n, n + 4).reshape(x.shape)

    @staticmethod
    def decode_tile(codes: jax.Array, scale_rows: list[jax.Array], ptx: bool) -> jax.Array:
        """codes [64, 8c] uint32 (c chunks of 4 blocks), scale_rows: 4c per-row e4m3 block scales [64]
        -> float16 [64, 64c]: W's values times E2M1_UNIT in the permuted K order, chunk by chunk."""
        rows, width = codes.shape
        chunks = []
        for c in range(width // _CHUNK_WORDS):
            words = codes[:, c * _CHUNK_WORDS:(c + 1) * _CHUNK_WORDS]
            blocks = scale_rows[4 * c:4 * c + 4]
            if ptx:
                scales = [lax.broadcast_in_dim(lax.bitcast_convert_type(s, jnp.uint8), (rows, _CHUNK_WORDS), (0,))
                          for s in blocks]
                chunks += list(_ptx_decode(words, scales))
                continue
            # the thread of column 2q + j holds block q: scale per column = block (column % 8) // 2
            per_column = jnp.stack([s.astype(jnp.float16) for s in blocks], axis=1)  # [64, 4]
            per_column = jnp.repeat(per_column, 2, axis=1)  # [64, 8]
            for odd in (0, 1):
                for nibble in ("lo", "hi"):
                    for half in (0, 1):
                        chunks.append(_lane_split(words, half, nibble, odd) * per_column)
        return jnp.concatenate(chunks, axis=1)


def on_words(params):
    """params (any pytree, e.g. ModelParams) with every weight-only NVFP4Weight on the candidate path;
    activation-quantised (W4A4) and other weights as they are."""
    words = lambda w: (NVFP4WordsWeight.from_nvfp4(w) if isinstance(w, NVFP4Weight) and w.input_scale is None
                       else w)
    return jax.tree.map(words, params, is_leaf=is_quantized)
