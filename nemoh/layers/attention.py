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
from nemoh.layers.context import TokenContext
from nemoh.layers.protocol import StateShape
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
    """Masked GQA softmax attention in fp32.

    q [b, T, Hq, D]; k, v [b, S, Hkv, D] (key j sits at position j); q_pos [b, T]; kv_len [b]: keys
    at positions >= kv_len are absent. Query t sees keys j <= q_pos[t]. Returns [b, T, Hq, D] in q.dtype.
    """
    b, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(b, T, Hkv, Hq // Hkv, D).astype(jnp.float32)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    scores = scores * (D ** -0.5)
    key_pos = jnp.arange(k.shape[1])
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < kv_len[:, None, None])
    # a finite floor keeps fully masked (padding) rows finite instead of NaN
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
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


def attention_mixer(p: AttentionParams, h: jax.Array, cfg: NemotronHConfig, pages: KVPages | None,
                    ctx: TokenContext) -> tuple[jax.Array, KVPages | None]:
    """h [b, T, H] (normed) -> (out [b, T, H], pool with this block's keys/values written).

    Without pages, the block attends to itself (full-sequence forward from position 0).
    """
    b, T, _ = h.shape
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = linear(h, p.q_proj).reshape(b, T, Hq, D)
    k = linear(h, p.k_proj).reshape(b, T, Hkv, D)
    v = linear(h, p.v_proj).reshape(b, T, Hkv, D)
    if pages is None:
        out = attend(q, k, v, ctx.positions, ctx.valid_len)
    else:
        pages = write_pages(pages, k, v, ctx)
        kv_len = ctx.positions[:, 0] + ctx.valid_len
        out = attend(q, gather_pages(pages.k, ctx.block_tables), gather_pages(pages.v, ctx.block_tables),
                     ctx.positions, kv_len)
    return linear(out.reshape(b, T, Hq * D), p.o_proj), pages
