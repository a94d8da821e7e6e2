"""Mamba2's one-token decode step as one kernel: the causal conv window update, SiLU, dt, and the SSM
state update and readout, between the in_proj and the gated norm.

XLA runs this step as ~7 small fusions a layer (the conv, dt, the state update, the readout over N, the
window), each a launch of ~1.5 µs at batch 1 whatever its work, and reads the fp32 state more than once.
Here one program per (sequence, head) reads the head's conv channels, its group's B and C channels and
its [hd, N] state once, and writes the new state in place (the state is aliased to the output).

Math (per sequence b, head h of group g; fp32; a row with valid[b] false is a no-op: dt = 0, x = 0,
window kept):
    xbc_act = silu(sum_k window_k * w_k + xbc * w_{K-1} + bias)       conv over K taps, per channel
    dt = clip(softplus(dt_raw + dt_bias))         S = exp(dt * A) * S + dt * x (outer) B
    y = S @ C + D * x                             A = -exp(A_log)
Its reference is nemoh's Mamba2 mixer at T = 1 (causal_conv, then ssd_step), which the tests compare
it with. Triton lowering (pl.pallas_call): an elementwise and reduction kernel with no tensor-core work.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _blocked
from pallas_kernels._backend import resolve_impl


def mamba_step_impl(head_dim: int, state_size: int, impl: str | None = None) -> str | None:
    """The impl ("pallas" or "interpret") mamba_step runs under for these widths, or None where the
    step stays with XLA: impl "xla", Tiling.mamba_step off, or widths that are not powers of two (Triton
    blocks)."""
    impl = resolve_impl(impl)
    powers = all(n >= 1 and n & (n - 1) == 0 for n in (head_dim, state_size))
    return impl if impl != "xla" and _blocked.DEFAULT_TILING.mamba_step and powers else None


def mamba_step(zxbcdt, window, conv_weight, conv_bias, dt_bias, A_log, D, ssm, valid, *, n_groups: int,
               time_step_limit: tuple[float, float], impl: str):
    """One token of a Mamba2 layer between its projections.

    zxbcdt [b, 2I + 2GN + nh] (in_proj's output: z, xBC, dt); window [b, K-1, conv_dim] (the raw xBC rows
    before this one); conv_weight [conv_dim, K]; conv_bias [conv_dim] or None; dt_bias, A_log, D [nh];
    ssm [b, nh, hd, N] fp32; valid [b] bool. impl: "pallas" or "interpret" (mamba_step_impl).
    Returns (y [b, I] fp32 before the gated norm, new window [b, K-1, conv_dim] in window's dtype,
    new ssm [b, nh, hd, N] fp32).
    """
    b, taps, conv_dim = window.shape[0], conv_weight.shape[1], conv_weight.shape[0]
    _, nh, hd, n = ssm.shape
    inner = nh * hd
    zeros = jnp.zeros((conv_dim,), jnp.float32)
    kernel = functools.partial(_step_kernel, inner=inner, n_groups=n_groups, heads=nh, taps=taps,
                               limit=tuple(time_step_limit), xbc_dtype=zxbcdt.dtype)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, h: (0,) * a.ndim)
    operands = (zxbcdt, window, conv_weight, zeros if conv_bias is None else conv_bias, dt_bias, A_log, D,
                valid.astype(jnp.int32), ssm)
    state_spec = pl.BlockSpec((None, None, hd, n), lambda i, h: (i, h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, nh),
        in_specs=[whole(a) for a in operands[:-1]] + [state_spec],
        out_specs=[pl.BlockSpec((None, hd), lambda i, h: (i, h)), whole(window), state_spec],
        out_shape=[jax.ShapeDtypeStruct((b, inner), jnp.float32), jax.ShapeDtypeStruct(window.shape, window.dtype),
                   jax.ShapeDtypeStruct(ssm.shape, jnp.float32)],
        input_output_aliases={len(operands) - 1: 2},
        interpret=impl == "interpret",
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="mamba_step",
    )(*operands)


def _step_kernel(zxbcdt_ref, window_ref, conv_w_ref, conv_b_ref, dt_bias_ref, a_log_ref, d_ref, valid_ref, ssm_ref,
                 y_ref, window_out_ref, ssm_out_ref, *, inner, n_groups, heads, taps, limit, xbc_dtype):
    """Program (sequence i, head h). The window of the group's B and C channels is written by the group's
    first head (every head of the group reads them)."""
    i, h = pl.program_id(0), pl.program_id(1)
    hd, n = ssm_ref.shape
    per_group = heads // n_groups
    g = h // per_group
    valid = valid_ref[i] != 0

    def conv(start, size):
        """Conv + SiLU of channels [start, start + size) and their next window rows, which drop the
        oldest row for a valid token (the raw row joins last) and stay as they were for a padding row."""
        chans = pl.ds(start, size)
        rows = [window_ref[i, k, chans].astype(xbc_dtype) for k in range(taps - 1)]
        rows.append(zxbcdt_ref[i, pl.ds(inner + start, size)])
        out = sum(row.astype(jnp.float32) * conv_w_ref[chans, k].astype(jnp.float32) for k, row in enumerate(rows))
        out = out + conv_b_ref[chans].astype(jnp.float32)
        kept = [jnp.where(valid, rows[k + 1], rows[k]) for k in range(taps - 1)]
        return jax.nn.silu(out), chans, kept

    def write_window(chans, kept):
        for k, row in enumerate(kept):
            window_out_ref[i, k, chans] = row.astype(window_out_ref.dtype)

    x, x_chans, x_window = conv(h * hd, hd)
    B, b_chans, b_window = conv(inner + g * n, n)
    C, c_chans, c_window = conv(inner + n_groups * n + g * n, n)
    write_window(x_chans, x_window)

    @pl.when(h % per_group == 0)
    def _():
        write_window(b_chans, b_window)
        write_window(c_chans, c_window)

    dt = jax.nn.softplus(zxbcdt_ref[i, 2 * inner + 2 * n_groups * n + h].astype(jnp.float32)
                         + dt_bias_ref[h].astype(jnp.float32))
    if limit != (0.0, math.inf):
        dt = jnp.clip(dt, *limit)
    dt = jnp.where(valid, dt, 0.0)
    x = jnp.where(valid, x, 0.0)
    A = -jnp.exp(a_log_ref[h].astype(jnp.float32))
    state = jnp.exp(dt * A) * ssm_ref[...] + (dt * x)[:, None] * B[None, :]
    ssm_out_ref[...] = state
    y_ref[...] = jnp.sum(state * C[None, :], axis=1) + d_ref[h].astype(jnp.float32) * x
