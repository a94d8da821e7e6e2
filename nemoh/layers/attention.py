"""Causal GQA attention (no rotary embedding, no bias), over the block itself or a paged KV cache.

The paged cache is a pool of pages [num_pages, page_size, Hkv, D] per layer; a sequence's block
table row lists its pages in order, so token position p lives in page block_table[p // page_size]
at slot p % page_size. New keys/values are written first, then queries read every cached key up to
their own position: the same code serves chunked prefill (T rows) and decode (T = 1).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from nemoh.config import ATTENTION, NemotronHConfig
from nemoh.errors import MeshError
from nemoh.layers.context import TokenContext
from nemoh.layers.protocol import StateShape
from nemoh.sharding.local import axis_position, fit_rows, per_device, psum32, rows_spec
from nemoh.sharding.rules import BATCH, KV_HEADS, Q_HEADS
from pallas_kernels import Weight, linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """norm [H]; q_proj [Hq*D, H]; k_proj, v_proj [Hkv*D, H]; o_proj [H, Hq*D]."""

    norm: jax.Array
    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    o_proj: Weight

    HF_KIND: ClassVar[str] = ATTENTION

    def mix(self, h, cfg, state, ctx):
        return attention_mixer(self, h, cfg, state, ctx)

    def init_state(self, cfg, shape: StateShape) -> "KVPages":
        return KVPages.zeros(cfg, shape.num_pages, shape.page_size, shape.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPages:
    """One attention layer's page pool: k, v [num_pages, page_size, Hkv, D]."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def zeros(cfg: NemotronHConfig, num_pages: int, page_size: int, dtype) -> "KVPages":
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        return KVPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_len: jax.Array) -> jax.Array:
    """Masked GQA softmax attention, scores and softmax in fp32.

    q [b, T, Hq, D]; k, v [b, S, Hkv, D] (key j sits at position j); q_pos [b, T]; kv_len [b]: keys
    at positions >= kv_len are absent. Query t sees keys j <= q_pos[t]. Returns [b, T, Hq, D] in q.dtype.
    Scores of bf16/f16 q and k multiply in that dtype with fp32 accumulation (each product is exact in
    fp32, and the tensor cores run it); fp32 inputs multiply at full fp32 precision. With 16-bit q and v
    the probabilities are rounded to v's dtype before the product with v (fp32 accumulation), as the
    reference model does in its own dtype; fp32 keeps them fp32. The [b, g, T, r, S] score layout is the
    dot's own output order, so no pass transposes the scores (at a 2,048-token chunk over 4,096 keys they
    are 1 GiB in fp32 a layer).
    """
    b, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(b, T, Hkv, Hq // Hkv, D)
    if q.dtype != k.dtype or q.dtype == jnp.float32:
        qg, k = qg.astype(jnp.float32), k.astype(jnp.float32)
    scores = jnp.einsum("btgrd,bsgd->bgtrs", qg, k, precision=jax.lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    scores = scores * (D ** -0.5)
    key_pos = jnp.arange(k.shape[1])
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < kv_len[:, None, None])
    # a finite floor keeps fully masked (padding) rows finite instead of NaN
    scores = jnp.where(visible[:, None, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    if q.dtype == v.dtype and q.dtype != jnp.float32:
        out = jnp.einsum("bgtrs,bsgd->btgrd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("bgtrs,bsgd->btgrd", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, T, Hq, D).astype(q.dtype)


def write_pages(pages: KVPages, k: jax.Array, v: jax.Array, ctx: TokenContext) -> KVPages:
    """Scatter the block's real rows (k, v [b, T, Hkv, D]) into the pool; padding rows are dropped."""
    num_pages, page_size = pages.k.shape[:2]
    b, T = ctx.positions.shape
    page = jnp.take_along_axis(ctx.block_tables, ctx.positions // page_size, axis=1)
    flat = page * page_size + ctx.positions % page_size
    real = jnp.arange(T)[None, :] < ctx.valid_len[:, None]
    flat = jnp.where(real, flat, num_pages * page_size).reshape(-1)  # out of range -> dropped

    def put(pool, new):
        pool_flat = pool.reshape(num_pages * page_size, *pool.shape[2:])
        pool_flat = pool_flat.at[flat].set(new.reshape(b * T, *new.shape[2:]).astype(pool.dtype), mode="drop")
        return pool_flat.reshape(pool.shape)

    return KVPages(k=put(pages.k, k), v=put(pages.v, v))


def gather_pages(pool: jax.Array, block_tables: jax.Array) -> jax.Array:
    """pool [num_pages, page_size, Hkv, D], block_tables [b, P] -> [b, P*page_size, Hkv, D]."""
    g = pool[block_tables]
    return g.reshape(g.shape[0], -1, *g.shape[3:])


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, pages: KVPages | None, ctx: TokenContext,
                     kv_heads: tuple | None = None) -> tuple[jax.Array, KVPages | None]:
    """q [b, T, Hq, D], k, v [b, T, Hkv, D] -> (out [b, T, Hq, D], pool with k, v written). Without pages
    the block attends to itself. kv_heads (start, count): the queries read only these kv heads (a
    device holding some query heads of a pool it shares); None: all.

    A prompt's first chunk (T > 1, every row at position 0) has no earlier keys: it attends to its own
    block, T keys, instead of the whole pool's S (a 2,048-token prompt in a 4,096-token row: half the
    scores), through a lax.cond, as the chunk index is a runtime value of prefill's loop."""
    def attend_to(keys, values, kv_len):
        if kv_heads is not None:
            keys, values = (jax.lax.dynamic_slice_in_dim(a, kv_heads[0], kv_heads[1], axis=2) for a in (keys, values))
        return attend(q, keys, values, ctx.positions, kv_len)

    if pages is None:
        return attend_to(k, v, ctx.valid_len), None
    pages = write_pages(pages, k, v, ctx)

    def pooled(pages):
        return attend_to(gather_pages(pages.k, ctx.block_tables), gather_pages(pages.v, ctx.block_tables),
                         ctx.positions[:, 0] + ctx.valid_len)

    if q.shape[1] == 1:  # decode
        return pooled(pages), pages

    def own(pages):  # the chunk's keys and values as the pool holds them
        return attend_to(k.astype(pages.k.dtype), v.astype(pages.v.dtype), ctx.valid_len)

    return jax.lax.cond(jnp.all(ctx.positions[:, 0] == 0), own, pooled, pages), pages


def _project(p: AttentionParams, h: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [b, T, H] -> q [b, T, Hq, D], k, v [b, T, Hkv, D] (head counts from the weights: local on a shard)."""
    b, T, _ = h.shape
    return tuple(linear(h, w).reshape(b, T, -1, head_dim) for w in (p.q_proj, p.k_proj, p.v_proj))


def attention_mixer(p: AttentionParams, h: jax.Array, cfg: NemotronHConfig, pages: KVPages | None,
                    ctx: TokenContext) -> tuple[jax.Array, KVPages | None]:
    """h [b, T, H] (normed) -> (out [b, T, H], pool with this block's keys/values written).

    Without pages, the block attends to itself (full-sequence forward from position 0). Under a
    sharded program (ctx.placement) attention_sharded runs.
    """
    if ctx.placement is not None:
        return attention_sharded(p, h, cfg, pages, ctx)
    b, T, _ = h.shape
    out, pages = cached_attention(*_project(p, h, cfg.head_dim), pages, ctx)
    return linear(out.reshape(b, T, -1), p.o_proj), pages


def attention_sharded(p: AttentionParams, h: jax.Array, cfg: NemotronHConfig, pages: KVPages | None,
                      ctx: TokenContext) -> tuple[jax.Array, KVPages | None]:
    """attention_mixer over a mesh: the query heads split n ways over the mesh axes of "q_heads" (q_proj
    by rows, o_proj by columns, one psum). The kv heads split alike, or (NemotronH has few) stay whole on
    every device: each device then writes every kv head into its copy of the pool and its queries read
    only the kv heads of their group. Pages split with the batch rows, each batch shard's block tables
    naming pages of its own part of the pool (kv_pages.block_tables)."""
    placement = fit_rows(ctx.placement, h.shape[0])
    heads, n = placement.axes(Q_HEADS), placement.ways(Q_HEADS)
    kv_axes = placement.axes(KV_HEADS)
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    group, local_q = Hq // Hkv, Hq // n
    if kv_axes not in ((), heads):
        raise MeshError(f"rules: {KV_HEADS!r} splits over {kv_axes} but {Q_HEADS!r} over {heads}; split them "
                        f"alike, or map {KV_HEADS!r} to None")
    if not kv_axes and local_q % group and group % local_q:
        raise MeshError(f"attention: {local_q} query heads per device (of {Hq}, over mesh axis {heads}) do not "
                        f"fit its {Hkv} kv groups of {group}; use another mesh or split {KV_HEADS!r} too")
    rows = placement.axes(BATCH)

    def local(p, h, pages, positions, valid_len, block_tables):
        b, T, _ = h.shape
        reads = None if kv_axes else (axis_position(heads) * local_q // group, max(1, local_q // group))
        mine = TokenContext(positions=positions, valid_len=valid_len, block_tables=block_tables)
        out, pages = cached_attention(*_project(p, h, cfg.head_dim), pages, mine, reads)
        return psum32(linear(out.reshape(b, T, -1), p.o_proj), heads), pages

    pages_spec = placement.specs(pages)
    table_spec = None if ctx.block_tables is None else rows_spec(rows, 2)
    return per_device(placement, local,
                      (placement.specs(p), rows_spec(rows, 3), pages_spec, rows_spec(rows, 2), rows_spec(rows, 1),
                       table_spec),
                      (rows_spec(rows, 3), pages_spec))(p, h, pages, ctx.positions, ctx.valid_len, ctx.block_tables)
