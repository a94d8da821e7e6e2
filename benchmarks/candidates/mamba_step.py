"""Candidate fused Mamba2 decode step, to be timed against the library's XLA ops before it replaces them.

At batch 1 the part of a Mamba layer between in_proj and the gated norm (conv window update, depthwise
conv + SiLU, dt softplus, SSM state update, y = C.h + D x, the SiLU(z) gate) is seven small XLA launches
in a serial chain (~11 µs on an H100, run 5's trace in docs/BENCHMARKS.md), which CUDA-graph
concurrency cannot overlap. Here it is one Pallas kernel (Triton lowering), a program per (row, head):
the head's x, z and dt, its group's B and C (each program of a group recomputes their conv and writes
the same new window rows), its [hd, N] fp32 state read and written once. The grouped RMSNorm stays in
XLA (a group spans several heads' programs).

`fused_scan` has nemoh.layers.mamba2.mamba2_scan's signature: one-token calls run the kernel (on the
GPU, or the Pallas interpreter under default_impl("interpret")), every other call the library's.
benchmarks/decode.py --mamba-step swaps it in for the gate, the layer check and the timed model.
Written for Pallas' Triton lowering, the quickest way to learn what the fusion is worth; jax 0.11
deprecates that backend, so a kernel the library adopts is ported to Mosaic GPU first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from nemoh.layers import mamba2
from nemoh.layers.mamba2 import MambaState
from nemoh.layers.norms import group_rms_norm
from pallas_kernels._backend import resolve_impl

_LIBRARY_SCAN = mamba2.mamba2_scan


def _silu(v):
    return v * (1.0 / (1.0 + jnp.exp(-v)))


def _softplus(v):  # jnp.logaddexp(v, 0), as jax.nn.softplus computes it
    return jnp.maximum(v, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(v)))


def _kernel(zxbcdt_ref, win_ref, w_ref, bias_ref, dt_bias_ref, a_log_ref, d_ref, valid_ref, state_ref,
            u_ref, win_out_ref, state_out_ref, *, I, G, N, hd, nh, K, limit):
    b, h = pl.program_id(0), pl.program_id(1)
    per_group = nh // G
    g = h // per_group
    real = valid_ref[b] > 0

    def conv(first, size):
        """Channels [first, first + size) of xBC -> (SiLU(conv) fp32 [size], new window rows)."""
        chans = pl.ds(first, size)
        cur = zxbcdt_ref[b, pl.ds(I + first, size)]
        rows = [win_ref[b, r, chans] for r in range(K - 1)] + [cur]
        out = 0.0
        for k in range(K):
            out = out + rows[k].astype(jnp.float32) * w_ref[chans, k].astype(jnp.float32)
        out = out + bias_ref[chans].astype(jnp.float32)
        window = [jnp.where(real, rows[r + 1], rows[r]) for r in range(K - 1)]
        return _silu(out), window

    x, x_win = conv(h * hd, hd)
    B, b_win = conv(I + g * N, N)
    C, c_win = conv(I + G * N + g * N, N)
    for r in range(K - 1):  # a group's programs all write the same B and C rows (same inputs, same values)
        win_out_ref[b, r, pl.ds(h * hd, hd)] = x_win[r]
        win_out_ref[b, r, pl.ds(I + g * N, N)] = b_win[r]
        win_out_ref[b, r, pl.ds(I + G * N + g * N, N)] = c_win[r]

    dt = _softplus(zxbcdt_ref[b, 2 * I + 2 * G * N + h].astype(jnp.float32)
                   + dt_bias_ref[h].astype(jnp.float32))
    if limit is not None:
        dt = jnp.clip(dt, *limit)
    dt = jnp.where(real, dt, 0.0)
    x = jnp.where(real, x, 0.0)
    decay = jnp.exp(dt * -jnp.exp(a_log_ref[h].astype(jnp.float32)))
    state = state_ref[b, h, pl.ds(0, hd), pl.ds(0, N)]
    new = decay * state + (dt * x)[:, None] * B[None, :]
    state_out_ref[b, h, pl.ds(0, hd), pl.ds(0, N)] = new
    y = jnp.sum(new * C[None, :], axis=1) + d_ref[h].astype(jnp.float32) * x
    z = zxbcdt_ref[b, pl.ds(h * hd, hd)].astype(jnp.float32)
    u_ref[b, pl.ds(h * hd, hd)] = y * _silu(z)


def decode_step(p, zxbcdt, cfg, state: MambaState, valid_len, impl: str):
    """zxbcdt [b, in_proj_dim] -> (gated y [b, I] fp32 before the group norm, new state)."""
    b = zxbcdt.shape[0]
    I, G, N, hd, nh = (cfg.mamba_intermediate, cfg.n_groups, cfg.ssm_state_size, cfg.mamba_head_dim,
                       cfg.mamba_num_heads)
    limit = None if tuple(cfg.time_step_limit) == (0.0, float("inf")) else tuple(cfg.time_step_limit)
    kernel = functools.partial(_kernel, I=I, G=G, N=N, hd=hd, nh=nh, K=cfg.conv_kernel, limit=limit)
    bias = jnp.zeros(p.conv_weight.shape[:1], p.conv_weight.dtype) if p.conv_bias is None else p.conv_bias
    operands = [zxbcdt, state.conv, p.conv_weight, bias, p.dt_bias, p.A_log, p.D, valid_len.astype(jnp.int32),
                state.ssm]
    u, conv, ssm = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, I), jnp.float32), jax.ShapeDtypeStruct(state.conv.shape, state.conv.dtype),
                   jax.ShapeDtypeStruct(state.ssm.shape, jnp.float32)),
        grid=(b, nh),
        # the state in place (each program reads and writes its own [hd, N] block); the window not: a
        # group's B and C rows are read and written by all its programs
        input_output_aliases={len(operands) - 1: 2},
        interpret=impl == "interpret",
        compiler_params=plt.CompilerParams(num_warps=4),
        name="mamba_decode_step",
    )(*operands)
    return u, MambaState(conv=conv, ssm=ssm)


def fused_scan(p, zxbcdt, cfg, state: MambaState, valid_len):
    """mamba2_scan with one-token calls on the fused kernel (impl "pallas" on a GPU, "interpret" under
    default_impl("interpret")); everything else, and any call with non-power-of-two head or state
    sizes (Triton blocks), the library's."""
    impl = resolve_impl(None)
    pow2 = lambda n: n & (n - 1) == 0
    if zxbcdt.shape[1] != 1 or impl == "xla" or not (pow2(cfg.mamba_head_dim) and pow2(cfg.ssm_state_size)):
        return _LIBRARY_SCAN(p, zxbcdt, cfg, state, valid_len)
    u, new_state = decode_step(p, zxbcdt[:, 0], cfg, state, valid_len, impl)
    u = group_rms_norm(u, p.gate_norm, cfg.n_groups, cfg.layer_norm_epsilon)
    return u[:, None], new_state


def swap_in() -> None:
    """Make the library's Mamba layers run fused_scan (benchmarks/decode.py --mamba-step)."""
    mamba2.mamba2_scan = fused_scan
