"""The candidate fused Mamba2 decode step (benchmarks/candidates/mamba_step.py) in the Pallas interpreter
against the library's one-token path, and its Triton lowering for the GPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nemoh

from benchmarks.candidates.mamba_step import decode_step, fused_scan
from nemoh.config import NemotronHConfig
from nemoh.layers.mamba2 import MambaParams, MambaState, mamba2_scan
from nemoh.random_params import random_params
from oracle_configs import QUANTISABLE_WIDTHS
from pallas_kernels import default_impl

CONFIG = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "M"})


def _inputs(cfg, dtype, seed=0):
    p = next(layer for layer in random_params(cfg, dtype=dtype, seed=seed).layers if isinstance(layer, MambaParams))
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    b = 3
    zxbcdt = jax.random.normal(k1, (b, 1, cfg.in_proj_dim), jnp.float32).astype(dtype)
    state = MambaState(conv=jax.random.normal(k2, (b, cfg.conv_kernel - 1, cfg.conv_dim), jnp.float32).astype(dtype),
                       ssm=jax.random.normal(k3, (b, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)))
    p = dataclasses.replace(p, conv_bias=jax.random.normal(k4, (cfg.conv_dim,), jnp.float32).astype(dtype))
    return p, zxbcdt, state, jnp.asarray([1, 0, 1], jnp.int32)  # the middle row is finished: no change


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.01, 0.5)])
def test_fused_step_matches_the_library(dtype, limit):
    cfg = dataclasses.replace(CONFIG, time_step_limit=limit)
    p, zxbcdt, state, valid = _inputs(cfg, dtype)
    want_u, want = mamba2_scan(p, zxbcdt, cfg, state, valid)
    with default_impl("interpret"):
        got_u, got = fused_scan(p, zxbcdt, cfg, state, valid)
    np.testing.assert_array_equal(np.asarray(got.conv), np.asarray(want.conv))
    np.testing.assert_allclose(np.asarray(got.ssm), np.asarray(want.ssm), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_u), np.asarray(want_u), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got.ssm[1]), np.asarray(state.ssm[1]))  # finished row untouched


def test_other_calls_take_the_library_path():
    p, zxbcdt, state, valid = _inputs(CONFIG, jnp.float32)
    two = jnp.concatenate([zxbcdt, zxbcdt], axis=1)
    with default_impl("interpret"):
        got_u, got = fused_scan(p, two, CONFIG, state, valid * 2)
    want_u, want = mamba2_scan(p, two, CONFIG, state, valid * 2)
    np.testing.assert_array_equal(np.asarray(got_u), np.asarray(want_u))


def test_lowers_for_the_gpu(as_hopper):
    """Lowered for "cuda" on the CPU (Triton IR for an H100): block shapes and ops Triton takes."""
    nano = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "M", "hidden_size": 2688,
                                      "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128,
                                      "n_groups": 8})
    p, zxbcdt, state, valid = jax.eval_shape(lambda: _inputs(nano, jnp.bfloat16))
    lowered = jax.jit(lambda p, z, s, v: decode_step(p, z[:, 0], nano, s, v, "pallas")).trace(
        p, zxbcdt, state, valid).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_decode_loop_on_the_fused_step(monkeypatch):
    """Swapped into the library (as decode.py --mamba-step does), the whole prefill + decode loop of a
    model gives the library's greedy tokens."""
    from benchmarks.candidates import mamba_step
    from nemoh.layers import mamba2

    real_step = mamba_step.decode_step

    cfg = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "M*M"})
    params = random_params(cfg, dtype=jnp.float32, seed=3)
    prompts = [[5, 9, 2, 7], [1, 4]]
    want = nemoh.generate(params, prompts, max_new_tokens=6, ignore_eos=True)
    monkeypatch.setattr(mamba2, "mamba2_scan", mamba_step.fused_scan)
    traced = []
    monkeypatch.setattr(mamba_step, "decode_step", lambda *a: traced.append(1) or real_step(*a))
    jax.clear_caches()  # the programs of the first call are traced again, now through the candidate
    with default_impl("interpret"):
        got = nemoh.generate(params, prompts, max_new_tokens=6, ignore_eos=True)
    assert traced and got == want
