"""The candidate NVFP4 data path (benchmarks/candidates/nvfp4_words.py) in the Mosaic GPU interpreter
against float64 numpy, and its lowering for the GPU. The interpreter runs the jnp model of the decode,
so this checks the activation permutation and the block each decoded column takes its scale from; the
PTX that replaces the model on the GPU is checked there (benchmarks/kernels.py --formats nvfp4w)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nemoh
from benchmarks.candidates.nvfp4_words import NVFP4WordsWeight, on_words
from nemoh.config import NemotronHConfig
from oracle_configs import QUANTISABLE_WIDTHS
from pallas_kernels import NVFP4Weight, default_impl, is_quantized, linear, moe_experts
from pallas_kernels._blocked import Tiling


def _weight(rng, lead, n, k):
    packed = rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8)
    block = jnp.asarray(rng.uniform(0.05, 4.0, (*lead, n, k // 16)).astype(np.float32)).astype(jnp.float8_e4m3fn)
    glob = rng.uniform(0.002, 0.02, lead).astype(np.float32)
    return NVFP4WordsWeight.from_nvfp4(NVFP4Weight.from_hf(packed, block, glob))


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _rel(y, ref):
    y = _f64(y)
    assert np.isfinite(y).all()
    return np.abs(y - ref).max() / np.abs(ref).max()


def test_words_view_round_trips_and_dequantises_like_nvfp4():
    rng = np.random.default_rng(0)
    w = _weight(rng, (2,), 64, 96)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(w.as_nvfp4().dequantize()))
    assert w.shape == (2, 64, 96) and w.packed.dtype == jnp.uint32


def test_permutation_is_the_decode_order():
    """Column n = 8X + 2q + j of a 64-value chunk takes W's element 16q + 8 nib + 4 odd + 2 half + j."""
    x = jnp.arange(128, dtype=jnp.float32)[None]
    got = np.asarray(NVFP4WordsWeight.permute_activations(x))[0]
    bits = [(c, odd, nib, half, q, j) for c in range(2) for odd in range(2) for nib in range(2)
            for half in range(2) for q in range(4) for j in range(2)]
    want = [64 * c + 16 * q + 8 * nib + 4 * odd + 2 * half + j for c, odd, nib, half, q, j in bits]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows,k,tk", [(1, 2688, None), (3, 352, None), (40, 640, 8), (1, 2688, 32)])
def test_linear_matches_float64(rows, k, tk):
    rng = np.random.default_rng(rows + k)
    w = _weight(rng, (), 128, k)
    x = jnp.asarray(rng.normal(size=(rows, k)).astype(np.float32)).astype(jnp.bfloat16)
    ref = _f64(x) @ _f64(w.dequantize()).T
    assert _rel(linear(x, w, impl="interpret", tiling=Tiling(tk=tk)), ref) < 1e-2


def test_moe_one_token_matches_float64():
    rng = np.random.default_rng(5)
    up, down = _weight(rng, (6,), 64, 128), _weight(rng, (6,), 128, 64)
    x = jnp.asarray(rng.normal(size=(1, 128)).astype(np.float32)).astype(jnp.bfloat16)
    idx, weight = jnp.asarray([[0, 2, 5]], jnp.int32), jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32)
    up64, down64, x64 = _f64(up.dequantize()), _f64(down.dequantize()), _f64(x)[0]
    ref = sum(float(weight[0, j]) * (down64[e] @ np.square(np.maximum(up64[e] @ x64, 0.0)))
              for j, e in enumerate([0, 2, 5]))
    assert _rel(moe_experts(x, idx, weight, up, down, impl="interpret"), ref[None]) < 2e-2


def test_lowers_for_the_gpu():
    from jax import export

    rng = np.random.default_rng(6)
    w, up, down = _weight(rng, (), 256, 2688), _weight(rng, (4,), 1856, 2688), _weight(rng, (4,), 2688, 1856)
    x = jnp.asarray(rng.normal(size=(100, 2688)).astype(np.float32)).astype(jnp.bfloat16)
    for rows, tiling in ((1, None), (1, Tiling(tk=32)), (40, None)):  # decode blocks, long K step, prefill
        export.export(jax.jit(lambda x, w: linear(x, w, impl="pallas", tiling=tiling)), platforms=["cuda"])(x[:rows], w)
    for tokens in (1, 100):
        idx, weight = jnp.zeros((tokens, 2), jnp.int32), jnp.ones((tokens, 2), jnp.float32)
        export.export(jax.jit(lambda *a: moe_experts(*a, impl="pallas")), platforms=["cuda"])(
            x[:tokens], idx, weight, up, down)


def test_whole_model_on_the_candidate_path():
    """on_words moves every weight-only NVFP4 projection to the candidate; the model's logits through the
    interpreted kernels then match the library's path (same values, another summation order)."""
    cfg = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "ME*M-", "intermediate_size": 32})
    params = nemoh.random_params(cfg, "NVFP4", dtype=jnp.float32)
    words = on_words(params)
    kinds = lambda p: sorted({type(w).__name__ for w in jax.tree.leaves(p, is_leaf=is_quantized) if is_quantized(w)})
    assert kinds(params) == ["NVFP4Weight"] and kinds(words) == ["NVFP4WordsWeight"]
    tokens = jnp.asarray([[3, 7, 1, 4, 4, 9]], jnp.int32)
    with default_impl("interpret"):
        ours, theirs = nemoh.forward(words, tokens), nemoh.forward(params, tokens)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=1e-4)
