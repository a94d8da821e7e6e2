"""Mixture of experts: sigmoid router (fp32, correction bias for selection only, grouped top-k),
relu^2 experts, an unscaled shared expert, and optional latent projections around the routed path.

Routed experts run through pallas_kernels.moe_experts for any number of tokens: on the GPU it reads
only the selected experts' weights, in their stored (packed) form, for decode and prefill alike.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from nemoh.config import MOE, NemotronHConfig
from nemoh.layers.mlp import relu2_mlp
from nemoh.layers.protocol import Stateless
from pallas_kernels import Weight, linear, moe_experts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams(Stateless):
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

    HF_KIND: ClassVar[str] = MOE

    def mix(self, h, cfg, state, ctx):
        return moe_mixer(self, h, cfg, ctx.token_mask()), state


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


def moe_mixer(p: MoEParams, h: jax.Array, cfg: NemotronHConfig, valid: jax.Array | None = None) -> jax.Array:
    """h [..., H] (normed) -> [..., H]. valid [...] bool: tokens to route (padding and finished or empty
    batch slots are not sent to any expert, so they cost no expert weight reads); None routes all."""
    lead = h.shape[:-1]
    x = h.reshape(-1, h.shape[-1])
    idx, w = route(x, p.router, p.router_bias, cfg)
    xr = x if p.latent_in is None else linear(x, p.latent_in)
    routed = moe_experts(xr, idx, w, p.experts_up, p.experts_down,
                         valid=None if valid is None else valid.reshape(-1))
    if p.latent_out is not None:
        routed = linear(routed, p.latent_out)
    out = routed if p.shared_up is None else routed + relu2_mlp(p.shared_up, p.shared_down, x)
    return out.reshape(*lead, -1)
