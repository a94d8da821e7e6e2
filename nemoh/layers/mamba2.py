"""Mamba2 mixer: in_proj -> causal depthwise conv + SiLU -> SSM -> gated grouped RMSNorm -> out_proj.

One function serves the full-sequence forward, chunked prefill and one-token decode: the caller passes
the carried state (conv window + fp32 SSM state) or None for a fresh sequence, and `valid_len` when
rows are right-padded. Padding tokens never touch the state: their dt is zeroed (a no-op step) and the
conv window is taken from the last real rows.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nemoh.config import MAMBA, NemotronHConfig
from nemoh.errors import MeshError
from nemoh.layers.norms import gated_rms_norm
from nemoh.layers.protocol import StateShape
from nemoh.layers.ssd import ssd_chunked, ssd_step
from nemoh.sharding.local import axis_position, fit_rows, per_device, psum32, rows_spec
from nemoh.sharding.placement import Placement
from nemoh.sharding.rules import BATCH, MAMBA_CONV, MAMBA_HEADS, MAMBA_IN, MAMBA_INNER
from pallas_kernels import Weight, linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaParams:
    """norm [H]; in_proj [2I+2GN+nh, H]; conv_weight [conv_dim, K]; conv_bias [conv_dim] or None;
    A_log, D, dt_bias [nh] fp32; gate_norm [I]; out_proj [H, I]."""

    norm: jax.Array
    in_proj: Weight
    conv_weight: jax.Array
    conv_bias: jax.Array | None
    A_log: jax.Array
    D: jax.Array
    dt_bias: jax.Array
    gate_norm: jax.Array
    out_proj: Weight

    HF_KIND: ClassVar[str] = MAMBA

    def mix(self, h, cfg, state, ctx):
        return mamba2_mixer(self, h, cfg, state, ctx.valid_len, ctx.placement)

    def init_state(self, cfg, shape: StateShape) -> "MambaState":
        return MambaState.zeros(cfg, shape.batch, shape.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaState:
    """Per sequence slot: conv [b, K-1, conv_dim] (last K-1 raw xBC rows, model dtype);
    ssm [b, nh, hd, N] fp32."""

    conv: jax.Array
    ssm: jax.Array

    @staticmethod
    def zeros(cfg: NemotronHConfig, batch: int, dtype) -> "MambaState":
        return MambaState(
            conv=jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
            ssm=jnp.zeros((batch, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size), jnp.float32),
        )


def causal_conv(xbc: jax.Array, window: jax.Array, weight: jax.Array, bias: jax.Array | None,
                valid_len: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv over time, then SiLU.

    xbc [b, T, C] raw rows; window [b, K-1, C] the rows before them (zeros at sequence start);
    weight [C, K] (tap K-1 multiplies the current row); valid_len [b] real rows per batch row.
    Returns (activated [b, T, C] fp32, new window [b, K-1, C]: the last K-1 raw rows up to valid_len).
    """
    K = weight.shape[1]
    T = xbc.shape[1]
    full = jnp.concatenate([window.astype(xbc.dtype), xbc], axis=1)  # [b, K-1+T, C]
    fullf = full.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    out = sum(fullf[:, k : k + T] * w[:, k] for k in range(K))
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    idx = valid_len[:, None] + jnp.arange(K - 1)[None, :]  # window rows valid_len .. valid_len+K-2
    new_window = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return jax.nn.silu(out), new_window


def mamba2_mixer(p: MambaParams, h: jax.Array, cfg: NemotronHConfig, state: MambaState | None,
                 valid_len: jax.Array | None, placement: Placement | None = None) -> tuple[jax.Array, MambaState]:
    """h [b, T, H] (normed input) -> (out [b, T, H], state after the last valid row).

    state None starts from zeros; valid_len [b] (None: all T rows are real). placement: the mesh and
    rules of a sharded program (then mamba2_sharded runs).
    """
    b, T, _ = h.shape
    if state is None:
        state = MambaState.zeros(cfg, b, h.dtype)
    if valid_len is None:
        valid_len = jnp.full((b,), T, jnp.int32)
    if placement is not None:
        return mamba2_sharded(p, h, cfg, state, valid_len, placement)
    u, state = mamba2_scan(p, linear(h, p.in_proj), cfg, state, valid_len)
    return linear(u.astype(h.dtype), p.out_proj), state


def mamba2_scan(p: MambaParams, zxbcdt: jax.Array, cfg: NemotronHConfig, state: MambaState,
                valid_len: jax.Array) -> tuple[jax.Array, MambaState]:
    """What lies between the projections: zxbcdt [b, T, in_proj_dim] -> (gated, normed u [b, T, I] fp32,
    new state). Uses p's conv, A_log, D, dt_bias and gate_norm."""
    b, T, _ = zxbcdt.shape
    nh, hd, G, N, I = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size, cfg.mamba_intermediate
    z, xbc, dt_raw = jnp.split(zxbcdt, [I, I + cfg.conv_dim], axis=-1)
    xbc_act, new_window = causal_conv(xbc, state.conv, p.conv_weight, p.conv_bias, valid_len)
    x, B, C = jnp.split(xbc_act, [I, I + G * N], axis=-1)

    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + p.dt_bias.astype(jnp.float32))
    lo, hi = cfg.time_step_limit
    if (lo, hi) != (0.0, float("inf")):
        dt = jnp.clip(dt, lo, hi)
    real = jnp.arange(T)[None, :] < valid_len[:, None]
    dt = jnp.where(real[..., None], dt, 0.0)
    A = -jnp.exp(p.A_log.astype(jnp.float32))
    D = p.D.astype(jnp.float32)

    x = jnp.where(real[..., None], x, 0.0).reshape(b, T, nh, hd)  # padding rows carry nothing, not even NaN
    B = B.reshape(b, T, G, N)
    C = C.reshape(b, T, G, N)
    if T == 1:
        y, ssm = ssd_step(state.ssm, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
        y = y[:, None]
    else:
        y, ssm = ssd_chunked(x, dt, A, B, C, D, cfg.chunk_size, state.ssm)
    u = gated_rms_norm(y.reshape(b, T, I), z, p.gate_norm, G, cfg.layer_norm_epsilon)
    return u, MambaState(conv=new_window.astype(state.conv.dtype), ssm=ssm)


def _take(x: jax.Array, index, parts: list[tuple[int, int]], axis: int) -> jax.Array:
    """The concatenation, along `axis`, of this shard's slice of each part (offset, size of a slice):
    part i's slice starts at offset + index * size."""
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, offset + index * size, size, axis)
                            for offset, size in parts], axis=axis)


def mamba2_sharded(p: MambaParams, h: jax.Array, cfg: NemotronHConfig, state: MambaState, valid_len: jax.Array,
                   placement: Placement) -> tuple[jax.Array, MambaState]:
    """mamba2_mixer over a mesh, with the heads (and their groups) split n ways over the mesh axes of
    "mamba_heads". in_proj is row parallel (its input dim split over those of "mamba_in"): one psum
    gives every device the whole zxbcdt, of which each takes its heads' z, x, dt and its groups' B, C;
    the conv (small, replicated weights) and the scan run on them, then out_proj (split along I) and
    a second psum. The conv window in the carry holds each shard's channels [x, B, C] in turn."""
    heads, n = placement.axes(MAMBA_HEADS), placement.ways(MAMBA_HEADS)
    for logical in (MAMBA_INNER, MAMBA_CONV):
        if placement.axes(logical) != heads:
            raise MeshError(f"rules: {logical!r} splits over {placement.axes(logical)} but {MAMBA_HEADS!r} over "
                            f"{heads}; a Mamba layer needs them split alike")
    if cfg.n_groups % n:
        raise MeshError(f"Mamba n_groups={cfg.n_groups} does not divide over mesh axis {heads} of size {n}: the "
                        f"heads of one group cannot be split; map {MAMBA_HEADS!r}, {MAMBA_INNER!r} and "
                        f"{MAMBA_CONV!r} to another mesh axis (or None) in the rules")
    I, GN, nh = cfg.mamba_intermediate, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
    local_cfg = dataclasses.replace(cfg, mamba_num_heads=nh // n, n_groups=cfg.n_groups // n)
    channels = [(0, I // n), (I, GN // n), (I + GN, GN // n)]  # x, B, C in the conv channels
    columns = [(0, I // n)] + [(I + o, s) for o, s in channels] + [(2 * I + 2 * GN, nh // n)]  # z, xBC, dt
    placement = fit_rows(placement, h.shape[0])
    in_axes, rows = placement.axes(MAMBA_IN), placement.axes(BATCH)

    def local(p, h, state, valid_len):
        zxbcdt = psum32(linear(h, p.in_proj), in_axes)
        here = axis_position(heads)
        mine = dataclasses.replace(p, conv_weight=_take(p.conv_weight, here, channels, 0),
                                   conv_bias=None if p.conv_bias is None else _take(p.conv_bias, here, channels, 0))
        u, state = mamba2_scan(mine, _take(zxbcdt, here, columns, 2), local_cfg, state, valid_len)
        return psum32(linear(u.astype(h.dtype), p.out_proj), heads), state

    state_spec = placement.specs(state)
    return per_device(placement, local,
                      (placement.specs(p), P(rows or None, None, in_axes or None), state_spec, rows_spec(rows, 1)),
                      (rows_spec(rows, 3), state_spec))(p, h, state, valid_len)
