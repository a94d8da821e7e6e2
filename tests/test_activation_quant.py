"""Activation quantisation (weights with an input_scale): W8A8 FP8 and emulated W4A4 NVFP4 in
pallas_kernels.linear and moe_experts, against numpy references written from ModelOpt's formulas.

The numpy NVFP4 activation reference is nemoh's numpy quantiser (nemoh.io.quantize.nvfp4_quantize with
the input_scale as global scale: ModelOpt quantises activations with the same NVFP4QTensor arithmetic as
weights, and that quantiser is checked byte for byte against ModelOpt's exports in
test_modelopt_exports.py), dequantised in ModelOpt's order e2m1 * (block scale * input_scale).

Tolerances: the quantised activations are compared bit for bit. The kernel paths multiply exact codes
(e4m3, or e2m1 x e4m3) by exactly decoded weights with fp32 accumulation, so against a float64 product
of the same quantised operands they are off by fp32 accumulation and scale rounding only: 1e-5
(norm-relative) for f32 outputs; bf16 outputs add their rounding (2**-9): 5e-3.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nemoh.io.dequantize import unpack_nibbles
from nemoh.io.quantize import E2M1_VALUES, nvfp4_quantize
from pallas_kernels import FP8Weight, NVFP4Weight, dequantize, linear, moe_experts
from pallas_kernels.formats import e2m1_round

IMPL = os.environ.get("PALLAS_KERNELS_IMPL", "interpret")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 5e-3}


def _rng(seed):
    return np.random.default_rng(seed)


def np_fake_quant(x: np.ndarray, s: np.ndarray, fmt: str) -> np.ndarray:
    """ModelOpt's fake quantisation of float32 activations x [rows, K], one input_scale per row."""
    x = np.asarray(x, np.float32)
    s = np.broadcast_to(np.asarray(s, np.float32), x.shape[:1])
    if fmt == "fp8":
        codes = np.clip(x * (np.float32(1) / s[:, None]), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        return codes.astype(np.float32) * s[:, None]
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        packed, block, glob = nvfp4_quantize(x[r:r + 1], global_scale=s[r])
        values = E2M1_VALUES[unpack_nibbles(packed)].reshape(1, -1, 16)
        out[r] = (values * (block.astype(np.float32) * glob)[..., None]).reshape(-1)
    return out


def _activations(rng, rows, k):
    """Rows with a wide dynamic range, an all-zero block, and exact e2m1 / fp8 ties."""
    x = rng.normal(size=(rows, k)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (rows, 1))).astype(np.float32)
    x[0, :16] = 0.0
    x[1, :16] = np.array([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5, -3.5, 4, 2, 1, 0.5, -6, 0], np.float32)
    return x


def _amax_scales(x, fmt):
    """Per-row input scales as calibration gives them: amax / 448 (FP8) or amax / (6 * 448) (NVFP4)."""
    amax = np.abs(x).max(axis=1)
    return (amax / (448.0 if fmt == "fp8" else 2688.0)).astype(np.float32)


def test_e2m1_round_ties_to_even_and_saturates():
    a = jnp.asarray([0, .25, .26, .74, .75, 1.25, 1.26, 1.74, 1.75, 2.5, 2.51, 3.49, 3.5, 5, 5.01, 6, 7, 1e9],
                    jnp.float32)
    want = [0, 0, .5, .5, 1, 1, 1.5, 1.5, 2, 2, 3, 3, 4, 4, 6, 6, 6, 6]
    np.testing.assert_array_equal(np.asarray(e2m1_round(a)), want)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_input_quantisation_bit_exact(fmt):
    rng = _rng(1)
    x = _activations(rng, 6, 64)
    s = _amax_scales(x, fmt)
    s[1] = 1.0  # row 1 holds exact ties at unit block scale
    cls = FP8Weight if fmt == "fp8" else NVFP4Weight
    want = np_fake_quant(x, s, fmt)
    got = np.asarray(cls.fake_quantize_input(jnp.asarray(x), jnp.asarray(s)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert (got[0, :16] == 0).all()
    codes = np.asarray(cls.input_codes(jnp.asarray(x), jnp.asarray(s)), np.float32)
    np.testing.assert_allclose(codes * s[:, None], want, rtol=2**-23, atol=0)  # codes * s: one rounding
    if fmt == "nvfp4":  # codes are e2m1 x e4m3 values: exact in float16, the kernel's operand type
        np.testing.assert_array_equal(codes.astype(np.float16).astype(np.float32), codes)
    scalar = np.asarray(cls.fake_quantize_input(jnp.asarray(x[2:3]), s[2]))  # a 0-d scale broadcasts
    np.testing.assert_array_equal(scalar, want[2:3])


def _weight(fmt, rng, lead, n, k, input_scale):
    if fmt == "fp8":
        data = np.clip(rng.normal(0.0, 80.0, (*lead, n, k)), -448, 448).astype(np.float32)
        return FP8Weight.from_hf(jnp.asarray(data).astype(jnp.float8_e4m3fn),
                                 rng.uniform(0.002, 0.02, lead).astype(np.float32), input_scale)
    packed = rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8)
    block = jnp.asarray(rng.uniform(0.05, 4.0, (*lead, n, k // 16)).astype(np.float32)).astype(jnp.float8_e4m3fn)
    return NVFP4Weight.from_hf(packed, block, rng.uniform(0.002, 0.02, lead).astype(np.float32), input_scale)


def _check(y, ref, tol, what):
    y, ref = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64), np.asarray(ref, np.float64)
    assert y.shape == ref.shape and np.isfinite(y).all(), what
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < tol and np.abs(y - ref).max() / np.abs(ref).max() < 2 * tol, (what, err, tol)


# (impls): the interpreted kernel is slow on CPU, so it runs once per format; FP8's path is an XLA fp8 dot
@pytest.mark.parametrize("fmt,dtype,lead,impls", [
    ("fp8", jnp.float32, (13,), (IMPL, "xla")), ("fp8", jnp.bfloat16, (70,), (IMPL, "xla")),
    ("nvfp4", jnp.float32, (13,), (IMPL, "xla")), ("nvfp4", jnp.bfloat16, (2, 3), ("xla",))])
def test_linear_with_input_scale(fmt, dtype, lead, impls):
    """The kernel path (FP8: one fp8 dot; NVFP4: the weight-only kernel on exact codes) and the xla
    reference both equal the float64 product of the fake-quantised input and the dequantised weight."""
    rng = _rng(2)
    k, n = 96, 72
    x = jnp.asarray(rng.normal(size=(*lead, k)).astype(np.float32)).astype(dtype)
    xs = np.asarray(x.astype(jnp.float32)).reshape(-1, k)
    s = float(_amax_scales(xs, fmt).max())
    w = _weight(fmt, rng, (), n, k, s)
    xq = np_fake_quant(xs, s, fmt)
    if dtype == jnp.bfloat16:
        xq = xq.astype(ml_dtypes.bfloat16).astype(np.float32)  # the reference reads x_q in x.dtype
    ref = (xq.astype(np.float64) @ np.asarray(dequantize(w), np.float64).T).reshape(*lead, n)
    weight_only = linear(x, dataclasses.replace(w, input_scale=None), impl="xla")
    for impl in impls:
        y = linear(x, w, impl=impl)
        assert y.dtype == dtype
        _check(y, ref, TOL[dtype] if impl != "xla" or dtype == jnp.float32 else 1e-2, f"{fmt} {impl}")
    assert np.linalg.norm(np.asarray(weight_only, np.float64) - ref) / np.linalg.norm(ref) > 0.01  # A8 / A4 matter


T, TOPK, E, H, F = 5, 3, 6, 80, 48
EXPERT_IDX = np.array([[0, 2, 3], [2, 3, 0], [5, 2, 1], [2, 0, 3], [1, 2, 5]], np.int32)


def _moe_case(fmt, tokens, seed):
    rng = _rng(seed)
    idx = EXPERT_IDX if tokens == T else np.stack([rng.permutation(E)[:TOPK] for _ in range(tokens)]).astype(np.int32)
    x = rng.normal(size=(tokens, H)).astype(np.float32)
    weight = rng.uniform(0.1, 1.0, (tokens, TOPK)).astype(np.float32)
    s_up = (np.abs(x).max() / (448.0 if fmt == "fp8" else 2688.0) * rng.uniform(0.5, 1.5, E)).astype(np.float32)
    up = _weight(fmt, rng, (E,), F, H, s_up)
    up64 = np.asarray(dequantize(up), np.float64)
    h_max = max(np.square(np.maximum(up64[e] @ x[t], 0)).max() for t in range(tokens) for e in idx[t])
    s_down = (h_max / (448.0 if fmt == "fp8" else 2688.0) * rng.uniform(0.5, 1.5, E)).astype(np.float32)
    down = _weight(fmt, rng, (E,), H, F, s_down)
    return jnp.asarray(x), idx, jnp.asarray(weight), up, down


def _moe_ref(x, idx, weight, up, down, fmt):
    """float64 routed experts with each pair's input and hidden activation fake-quantised (float32) by
    its expert's input scales."""
    up64, down64 = np.asarray(dequantize(up), np.float64), np.asarray(dequantize(down), np.float64)
    y = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j, e in enumerate(idx[t]):
            xq = np_fake_quant(np.asarray(x)[t:t + 1], up.input_scale[e], fmt)[0]
            h = np.square(np.maximum(up64[e] @ xq, 0.0)).astype(np.float32)
            hq = np_fake_quant(h[None], down.input_scale[e], fmt)[0]
            y[t] += float(weight[t, j]) * (down64[e] @ hq)
    return y


# the kernel path once per format (its block routing is format-blind); the xla reference for few pairs
# (gather, as in decode) and for prefill (ragged_dot)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("tokens,impls", [(T, (IMPL, "xla")), (100, ("xla",))])
def test_moe_experts_with_input_scales(fmt, tokens, impls):
    x, idx, weight, up, down = _moe_case(fmt, tokens, seed=3)
    ref = _moe_ref(x, idx, weight, up, down, fmt)
    for impl in impls:
        _check(moe_experts(x, jnp.asarray(idx), weight, up, down, impl=impl), ref, 1e-4, f"moe {fmt} {impl}")


def test_input_scale_round_trips_through_hf_tensors():
    rng = _rng(4)
    w = _weight("nvfp4", rng, (3,), 16, 32, np.array([0.5, 0.25, 2.0], np.float32))
    hf = w.to_hf()
    assert set(hf) == {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    back = NVFP4Weight.from_hf(hf["weight"], hf["weight_scale"], hf["weight_scale_2"], hf["input_scale"])
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, w))
    assert "input_scale" not in FP8Weight.from_hf(jnp.zeros((2, 2), jnp.float8_e4m3fn), 1.0).to_hf()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_activation_quant_lowers_for_the_gpu(fmt):
    """The W8A8 fp8 dot and the W4A4 kernel path (linear and moe_experts) lower for CUDA from a CPU host."""
    from jax import export

    rng = _rng(5)
    w = _weight(fmt, rng, (), 256, 512, 0.01)
    up, down = _weight(fmt, rng, (4,), 256, 512, np.full(4, 0.01, np.float32)), \
        _weight(fmt, rng, (4,), 512, 256, np.full(4, 0.01, np.float32))
    for rows in (1, 40):
        x = jnp.asarray(rng.normal(size=(rows, 512)).astype(np.float32)).astype(jnp.bfloat16)
        export.export(jax.jit(lambda x, w: linear(x, w, impl="pallas")), platforms=["cuda"])(x, w)
        idx, weight = jnp.zeros((rows, 2), jnp.int32), jnp.ones((rows, 2), jnp.float32)
        export.export(jax.jit(lambda *a: moe_experts(*a, impl="pallas")), platforms=["cuda"])(x, idx, weight, up, down)
