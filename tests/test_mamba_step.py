"""Mamba2's fused one-token step (pallas_kernels.mamba_step) against the mixer's XLA path at T = 1: the
conv window bit for bit, the SSM state and the normed output to fp32 rounding, a padding row left
untouched; when the mixer takes it; and that it lowers for the GPU (Triton) on a CPU-only machine.
PALLAS_KERNELS_IMPL=pallas runs the comparison on the GPU (h200.sh kernel-tests)."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from nemoh import NemotronHConfig
from nemoh.layers.mamba2 import MambaParams, MambaState, mamba2_scan
from pallas_kernels import _blocked, default_impl
from pallas_kernels._blocked import Tiling
from pallas_kernels.mamba_step import mamba_step, mamba_step_impl

IMPL = os.environ.get("PALLAS_KERNELS_IMPL", "interpret")
DIMS = {"vocab_size": 64, "hidden_size": 32, "hybrid_override_pattern": "M", "mamba_num_heads": 8,
        "mamba_head_dim": 16, "ssm_state_size": 32, "n_groups": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 16}


def _layer(cfg: NemotronHConfig, rng, conv_bias: bool, window_dtype, batch: int):
    """Random Mamba2 parameters (projections unused: mamba2_scan lies between them), one token's in_proj
    output [b, 1, D] and a carried state with a nonzero window and SSM state."""
    f32 = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
    nh, I, C = cfg.mamba_num_heads, cfg.mamba_intermediate, cfg.conv_dim
    p = MambaParams(norm=None, in_proj=None, conv_weight=f32(C, cfg.conv_kernel, scale=0.5).astype(jnp.bfloat16),
                    conv_bias=f32(C).astype(jnp.bfloat16) if conv_bias else None, A_log=f32(nh, scale=0.5),
                    D=f32(nh), dt_bias=f32(nh), gate_norm=f32(I).astype(jnp.bfloat16), out_proj=None)
    zxbcdt = f32(batch, 1, cfg.in_proj_dim).astype(jnp.bfloat16)
    state = MambaState(conv=f32(batch, cfg.conv_kernel - 1, C).astype(window_dtype),
                       ssm=f32(batch, nh, cfg.mamba_head_dim, cfg.ssm_state_size))
    return p, zxbcdt, state


@pytest.mark.parametrize("conv_bias, limit, window_dtype", [(True, None, jnp.bfloat16), (False, (0.05, 0.6), jnp.bfloat16),
                                                            (True, None, jnp.float32)])
def test_step_matches_the_mixer(conv_bias, limit, window_dtype, monkeypatch):
    cfg = NemotronHConfig.from_dict({**DIMS, **({"time_step_limit": list(limit)} if limit else {})})
    p, zxbcdt, state = _layer(cfg, np.random.default_rng(3), conv_bias, window_dtype, batch=3)
    valid_len = jnp.array([1, 0, 1], jnp.int32)  # row 1 pads: its state must come back as it was
    scan = jax.jit(lambda p, z, s, v: mamba2_scan(p, z, cfg, s, v))
    with default_impl("xla"):
        u_ref, ref = scan(p, zxbcdt, state, valid_len)
    monkeypatch.setattr(_blocked, "DEFAULT_TILING", Tiling(mamba_step=True))
    with default_impl(IMPL):
        assert "pallas_call" in str(jax.make_jaxpr(lambda *a: mamba2_scan(*a, cfg, state, valid_len))(p, zxbcdt))
        u, got = jax.jit(lambda p, z, s, v: mamba2_scan(p, z, cfg, s, v))(p, zxbcdt, state, valid_len)
    assert got.conv.dtype == window_dtype and got.ssm.dtype == jnp.float32 and u.shape == u_ref.shape
    np.testing.assert_array_equal(np.asarray(got.conv, np.float32), np.asarray(ref.conv, np.float32))
    np.testing.assert_allclose(np.asarray(got.ssm), np.asarray(ref.ssm), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(u), np.asarray(u_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got.ssm[1]), np.asarray(state.ssm[1]))
    kept = state.conv[1].astype(zxbcdt.dtype)  # the window goes through xBC's dtype, as in the mixer
    np.testing.assert_array_equal(np.asarray(got.conv[1], np.float32), np.asarray(kept, np.float32))
    assert not np.array_equal(np.asarray(got.ssm[0]), np.asarray(state.ssm[0]))


def test_mixer_takes_the_kernel_only_where_it_applies(monkeypatch):
    """Off by default (Tiling.mamba_step), never under impl "xla", and only at power-of-two widths."""
    assert mamba_step_impl(64, 128, "interpret") is None
    monkeypatch.setattr(_blocked, "DEFAULT_TILING", Tiling(mamba_step=True))
    assert mamba_step_impl(64, 128, "interpret") == "interpret"
    assert mamba_step_impl(64, 128, "xla") is None
    assert mamba_step_impl(48, 128, "interpret") is None and mamba_step_impl(64, 96, "interpret") is None


def test_step_lowers_for_the_gpu():
    """The Triton lowering runs on a CPU-only machine for an abstract H100: Nano's widths (64 heads of
    64, 8 groups, state 128, 4 taps) lower to one Triton call."""
    cfg = NemotronHConfig.from_dict({**DIMS, "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128,
                                     "n_groups": 8})
    p, zxbcdt, state = _layer(cfg, np.random.default_rng(4), True, jnp.bfloat16, batch=2)
    step = lambda z, s: mamba_step(z[:, 0], s.conv, p.conv_weight, p.conv_bias, p.dt_bias, p.A_log, p.D, s.ssm,
                                   jnp.ones((2,), bool), n_groups=cfg.n_groups, time_step_limit=(0.0, math.inf),
                                   impl="pallas")
    h100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h100)):
        text = jax.jit(step).trace(zxbcdt, state).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1, text[:2000]
