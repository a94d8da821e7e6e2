"""Mixture of experts: sigmoid router (fp32, correction bias for selection only, grouped top-k),
relu^2 experts, an unscaled shared expert, and optional latent projections around the routed path.

Routed experts run through one of two paths chosen by the (static) number of token-expert pairs:
few pairs (decode) use pallas_kernels.moe_experts, which reads only the selected experts' weights;
many pairs (prefill) sort the pairs by expert and run jax.lax.ragged_dot, which is compute-bound there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nemoh.config import NemotronHConfig
from nemoh.layers.mlp import relu2, relu2_mlp
from pallas_kernels import Weight, dequantize, linear, moe_experts

# Token-expert pairs up to which the selected-experts kernel is used instead of grouped matmuls.
SELECTED_EXPERTS_MAX_PAIRS = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    """norm [H]; router [E, H] fp32; router_bias [E] fp32; experts_up [E, F, L]; experts_down [E, L, F]
    (L = moe_latent_size or H); shared_up [Fs, H], shared_down [H, Fs] or None;
    latent_in [L, H], latent_out [H, L] or None."""

    norm: jax.Array
    router: jax.Array
    router_bias: jax.Array
    experts_up: Weight
    experts_down: Weight
    shared_up: Weight | None
    shared_down: Weight | None
    latent_in: Weight | None
    latent_out: Weight | None


def route(x: jax.Array, router: jax.Array, bias: jax.Array, cfg: NemotronHConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, H] -> (expert ids [T, k] int32, routing weights [T, k] fp32).

    Scores are sigmoid(x @ router^T) in fp32; the correction bias only shifts the choice. With n_group
    > 1, a group scores the sum of its top-2 biased scores and only the best topk_group groups compete.
    """
    logits = jnp.einsum("th,eh->te", x.astype(jnp.float32), router.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, n_group]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        kept = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(kept, E // cfg.n_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


def experts_grouped(x: jax.Array, idx: jax.Array, w: jax.Array, up: Weight, down: Weight) -> jax.Array:
    """Routed experts for many tokens: sort (token, expert) pairs by expert, two ragged_dots.

    x [T, L]; idx, w [T, k]; up [E, F, L]; down [E, L, F] -> [T, L] in x.dtype. Quantised experts are
    dequantised to x.dtype for the grouped matmul (prefill is compute-bound; the weights are transient).
    """
    T, k = idx.shape
    E = up.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    up_t = jnp.swapaxes(dequantize(up, x.dtype), 1, 2)  # [E, L, F]
    down_t = jnp.swapaxes(dequantize(down, x.dtype), 1, 2)  # [E, F, L]
    h = jax.lax.ragged_dot(x[token], up_t, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    o = jax.lax.ragged_dot(relu2(h), down_t, sizes, preferred_element_type=jnp.float32)
    o = o * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[token].add(o).astype(x.dtype)


def routed_experts(x: jax.Array, idx: jax.Array, w: jax.Array, up: Weight, down: Weight) -> jax.Array:
    """Dispatch by the static number of token-expert pairs (see module docstring)."""
    if idx.size <= SELECTED_EXPERTS_MAX_PAIRS:
        return moe_experts(x, idx, w, up, down)
    return experts_grouped(x, idx, w, up, down)


def moe_mixer(p: MoEParams, h: jax.Array, cfg: NemotronHConfig) -> jax.Array:
    """h [..., H] (normed) -> [..., H]."""
    lead = h.shape[:-1]
    x = h.reshape(-1, h.shape[-1])
    idx, w = route(x, p.router, p.router_bias, cfg)
    xr = x if p.latent_in is None else linear(x, p.latent_in)
    routed = routed_experts(xr, idx, w, p.experts_up, p.experts_down)
    if p.latent_out is not None:
        routed = linear(routed, p.latent_out)
    out = routed if p.shared_up is None else routed + relu2_mlp(p.shared_up, p.shared_down, x)
    return out.reshape(*lead, -1)
