"""RMSNorm and the Mamba2 gated grouped RMSNorm, both computed in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., H] -> x * rsqrt(mean(x^2) + eps) * weight, in fp32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def gated_rms_norm(y: jax.Array, z: jax.Array, weight: jax.Array, n_groups: int, eps: float) -> jax.Array:
    """Mamba2 output norm (norm_before_gate=False): u = y * silu(z), normalised per group.

    y, z [..., I]; the I channels split into n_groups contiguous groups of I/n_groups, each divided by
    its own RMS (not the RMS over all I: that is wrong for n_groups > 1). Returns fp32 [..., I].
    """
    return group_rms_norm(y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32)), weight, n_groups, eps)


def group_rms_norm(u: jax.Array, weight: jax.Array, n_groups: int, eps: float) -> jax.Array:
    """fp32 u [..., I] with each of n_groups contiguous channel groups divided by its own RMS, times
    weight [I]."""
    grouped = u.reshape(*u.shape[:-1], n_groups, u.shape[-1] // n_groups)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    return grouped.reshape(u.shape) * weight.astype(jnp.float32)
