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
from nemoh.errors import MeshError
from nemoh.layers.mlp import relu2_mlp
from nemoh.layers.protocol import Stateless
from nemoh.sharding.local import axis_position, first_only, fit_rows, per_device, psum32, rows_spec
from nemoh.sharding.placement import Placement
from nemoh.sharding.rules import BATCH, SHARED_MLP
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
        return moe_mixer(self, h, cfg, ctx.token_mask(), ctx.placement), state


ROUTER_REDUCE_TOKENS = 64  # router products of up to this many tokens as one fused reduction, not a GEMM


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """x [T, H], router [E, H] -> x @ router^T [T, E] in fp32 (full-precision products).

    Decode-size T (<= ROUTER_REDUCE_TOKENS) multiplies and sums in one XLA reduction: as a dot, XLA on
    the GPU runs a float32 SIMT GEMM with a split-K pass for it (H100, 32 tokens of Nano's 2688 x 128
    router: ~20 µs a MoE layer for 1.4 MB of weights). Larger T stays a dot."""
    xf, rf = x.astype(jnp.float32), router.astype(jnp.float32)
    if x.shape[0] <= ROUTER_REDUCE_TOKENS:
        return jnp.sum(xf[:, None, :] * rf[None, :, :], axis=-1)
    return jnp.einsum("th,eh->te", xf, rf, precision=jax.lax.Precision.HIGHEST)


RANKED_TOP_K_MAX = 1 << 21  # top_k ranks inputs of up to this many entry pairs (a decode batch's scores)


def top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k(values, k), by ranked_top_k where values [..., E] hold at most RANKED_TOP_K_MAX
    pairs of entries (size * E: up to 128 tokens of 128 expert scores), else by lax.top_k itself: ranking
    costs E comparisons an entry (on the CPU 67 ms against 1.5 ms for 2,048 tokens of 128 scores)."""
    if values.size * values.shape[-1] <= RANKED_TOP_K_MAX:
        return ranked_top_k(values, k)
    return jax.lax.top_k(values, k)


def ranked_top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k(values, k) for values [..., E] (largest first in IEEE total order, NaN above inf and
    +0 above -0; among equal values the lower index first), computed from each entry's rank among the E:
    one compare-and-count that XLA fuses into a reduction, then a pick of ranks 0..k-1, where lax.top_k
    sorts on the GPU (5.8 µs on an H100 for a decode token's 128 expert scores, on the MoE layer's
    critical path). Returns (values [..., k], int32 indices [..., k])."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order of key == total order of the floats
    ids = jnp.arange(values.shape[-1], dtype=jnp.int32)
    ahead = (key[..., None, :] > key[..., :, None]) | ((key[..., None, :] == key[..., :, None]) & (ids < ids[:, None]))
    rank = ahead.sum(-1, dtype=jnp.int32)  # [..., E]: how many entries come before each (a permutation)
    idx = jnp.sum(jnp.where(rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None], ids, 0), -1, dtype=jnp.int32)
    return jnp.take_along_axis(values, idx, axis=-1), idx


def route(x: jax.Array, router: jax.Array, bias: jax.Array, cfg: NemotronHConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, H] -> (expert ids [T, k] int32, routing weights [T, k] fp32).

    Scores are sigmoid(x @ router^T) in fp32; the correction bias only shifts the choice. With n_group
    > 1, a group scores the sum of its top-2 biased scores and only the best topk_group groups compete.
    """
    scores = jax.nn.sigmoid(router_logits(x, router))
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        group_scores = top_k(grouped, 2)[0].sum(-1)  # [T, n_group]
        _, keep = top_k(group_scores, cfg.topk_group)
        kept = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(kept, E // cfg.n_group, axis=1), choice, -jnp.inf)
    _, idx = top_k(choice, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


def _routed(p: MoEParams, x: jax.Array, cfg: NemotronHConfig, valid: jax.Array | None, experts) -> jax.Array:
    """The routed path of x [T, H] up to the latent space: route, latent_in, experts (moe_experts'
    signature) -> [T, L]."""
    idx, w = route(x, p.router, p.router_bias, cfg)
    xr = x if p.latent_in is None else linear(x, p.latent_in)
    return experts(xr, idx, w, p.experts_up, p.experts_down, valid=valid)


def _latent_out(p: MoEParams, y: jax.Array) -> jax.Array:
    return y if p.latent_out is None else linear(y, p.latent_out)


def _shared(p: MoEParams, x: jax.Array) -> jax.Array | None:
    return None if p.shared_up is None else relu2_mlp(p.shared_up, p.shared_down, x)


def moe_mixer(p: MoEParams, h: jax.Array, cfg: NemotronHConfig, valid: jax.Array | None = None,
              placement: Placement | None = None) -> jax.Array:
    """h [..., H] (normed) -> [..., H]. valid [...] bool: tokens to route (padding and finished or empty
    batch slots are not sent to any expert, so they cost no expert weight reads); None routes all.
    placement: the mesh and rules of a sharded program (then moe_sharded runs)."""
    lead = h.shape[:-1]
    x = h.reshape(-1, h.shape[-1])
    valid = None if valid is None else valid.reshape(-1)
    if placement is not None:
        return moe_sharded(p, x, cfg, valid, placement).reshape(*lead, -1)
    routed, shared = _latent_out(p, _routed(p, x, cfg, valid, moe_experts)), _shared(p, x)
    out = routed if shared is None else routed + shared
    return out.reshape(*lead, -1)


def expert_axes(placement: Placement) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(mesh axes splitting the routed experts, mesh axes splitting their width); MeshError when the two
    stacks split differently or the experts split over the batch's axes."""
    dims = {f: tuple(placement.axes(a) if a else () for a in placement.rules.axes_of("MoEParams", f) or ())
            for f in ("experts_up", "experts_down")}
    (e_up, f_up, _), (e_down, _, f_down) = dims["experts_up"], dims["experts_down"]
    if (e_up, f_up) != (e_down, f_down):
        raise MeshError(f"rules: experts_up splits its experts over {e_up} and its width over {f_up}, experts_down "
                        f"over {e_down} and {f_down}; the sharded MoE needs them split alike")
    clash = set(e_up + f_up) & set(placement.axes(BATCH))
    if clash:
        raise MeshError(f"rules: mesh axes {sorted(clash)} split both the batch and the routed experts; the "
                        "sharded MoE needs them apart")
    return e_up, f_up


def own_experts(first, count: int):
    """moe_experts (same signature) run on the experts [first, first + count) a device holds, its stacks
    indexed locally: every (token, expert) pair routed elsewhere is left out (no weight reads)."""
    def run(xr, idx, w, up, down, valid=None):
        mine = (idx >= first) & (idx < first + count)
        return moe_experts(xr, jnp.where(mine, idx - first, 0), w, up, down,
                           valid=mine if valid is None else mine & valid[:, None])

    return run


def moe_sharded(p: MoEParams, x: jax.Array, cfg: NemotronHConfig, valid: jax.Array | None,
                placement: Placement) -> jax.Array:
    """moe_mixer over a mesh, x [T, H] -> [T, H]: experts split over the mesh axes of "experts" (expert
    parallel), their width over those of "expert_mlp" and the shared expert's over those of "shared_mlp"
    (tensor parallel); router and latent projections whole on every device.

    Exchange: a device holds the tokens of its batch shard (whole over the expert and tensor axes, as
    every layer leaves them), runs its own experts on the (token, expert) pairs routed to them and
    leaves out every other pair (no weight reads for them); one fp32 psum then adds the parts: one
    collective per layer whatever the top-k. With the shared expert whole on every device the routed
    parts are added in the latent space ([T, L]: a quarter of [T, H] for Nemotron-3 Super), else the
    routed and shared parts together ([T, H], over the expert and tensor axes). An all-to-all dispatch
    pays only when the tokens are spread over the expert axis (docs/multi_gpu.md has what was
    measured). Each device has its own operands, so moe_experts runs its kernel on a GPU."""
    placement = fit_rows(placement, x.shape[0])
    e_axes, f_axes = expert_axes(placement)
    s_axes = placement.axes(SHARED_MLP)
    axes = tuple(dict.fromkeys(e_axes + f_axes + s_axes))
    rows = placement.axes(BATCH)
    valid = jnp.ones(x.shape[:1], bool) if valid is None else valid

    def local(p, x, valid):
        count = p.experts_up.shape[0]
        routed, shared = _routed(p, x, cfg, valid, own_experts(axis_position(e_axes) * count, count)), _shared(p, x)
        if not s_axes:  # the shared expert is whole here: add the routed parts in the latent space
            routed = _latent_out(p, psum32(routed, e_axes + f_axes))
            return routed if shared is None else routed + shared
        out = first_only(_latent_out(p, routed), tuple(a for a in axes if a not in e_axes + f_axes))
        return psum32(out + first_only(shared, tuple(a for a in axes if a not in s_axes)), axes)

    return per_device(placement, local, (placement.specs(p), rows_spec(rows, 2), rows_spec(rows, 1)),
                      rows_spec(rows, 2))(p, x, valid)
