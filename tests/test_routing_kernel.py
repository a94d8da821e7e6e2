"""The candidate MoE routing kernel (benchmarks/candidates/routing.py) in the Pallas interpreter against
the library's route (same experts in the same order, ties included; the same weights), inside a whole
generate loop, and its Triton lowering for the GPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nemoh
from benchmarks.candidates import routing
from nemoh.config import NemotronHConfig
from nemoh.layers import moe
from nemoh.random_params import random_params
from oracle_configs import QUANTISABLE_WIDTHS
from pallas_kernels import default_impl

CONFIG = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "E", "n_routed_experts": 16,
                                    "num_experts_per_tok": 4, "routed_scaling_factor": 2.5})


def _inputs(seed, tokens=5, tie=False):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (tokens, CONFIG.hidden_size), jnp.float32)
    router = jax.random.normal(k2, (CONFIG.n_routed_experts, CONFIG.hidden_size), jnp.float32)
    bias = 0.1 * jax.random.normal(k3, (CONFIG.n_routed_experts,), jnp.float32)
    if tie:  # experts 3, 7 and 11 score alike: the lowest index comes first
        router, bias = router.at[7].set(router[3]).at[11].set(router[3]), bias.at[7].set(bias[3]).at[11].set(bias[3])
        router = router.at[3].multiply(3.0).at[7].multiply(3.0).at[11].multiply(3.0)
        bias = bias.at[3].set(5.0).at[7].set(5.0).at[11].set(5.0)
    return x, router, bias


@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize("tie", [False, True])
def test_same_experts_and_weights_as_the_library(normalise, tie):
    cfg = dataclasses.replace(CONFIG, norm_topk_prob=normalise)
    x, router, bias = _inputs(1, tie=tie)
    want_idx, want_w = moe.route(x, router, bias, cfg)
    with default_impl("interpret"):
        got_idx, got_w = routing.fused_route(x, router, bias, cfg)
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    if tie:
        assert [int(e) for e in got_idx[0, :3]] == [3, 7, 11]


def test_generate_with_the_kernel_gives_the_library_tokens(monkeypatch):
    cfg = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "ME", "n_routed_experts": 8,
                                     "num_experts_per_tok": 2})
    params = random_params(cfg, dtype=jnp.float32, seed=4)
    prompts = [[5, 9, 2, 7], [1, 4]]
    want = nemoh.generate(params, prompts, max_new_tokens=6, ignore_eos=True)
    traced = []
    real = routing.fused_route
    monkeypatch.setattr(moe, "route", lambda *a: traced.append(1) or real(*a))
    jax.clear_caches()
    with default_impl("interpret"):
        got = nemoh.generate(params, prompts, max_new_tokens=6, ignore_eos=True)
    assert traced and got == want


def test_lowers_for_the_gpu(as_hopper):
    cfg = dataclasses.replace(CONFIG, n_routed_experts=128, num_experts_per_tok=6)
    x = jax.ShapeDtypeStruct((32, 2688), jnp.bfloat16)
    router, bias = jax.ShapeDtypeStruct((128, 2688), jnp.float32), jax.ShapeDtypeStruct((128,), jnp.float32)
    with default_impl("pallas"):
        lowered = jax.jit(lambda *a: routing.fused_route(*a, cfg)).trace(x, router, bias).lower(
            lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
