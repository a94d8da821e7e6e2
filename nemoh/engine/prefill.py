"""Prefill: a ragged batch of prompts through the model in chunks, building the decode carry.

Prompts are right-padded to a whole number of chunks; each chunk runs with the carried states
threaded through, padding rows masked (no KV write, no Mamba state change), and each sequence's
last real hidden state kept for its first sampled token.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from nemoh.config import ATTENTION, MAMBA
from nemoh.engine.carry import DecodeCarry
from nemoh.engine.kv_pages import CacheSpec, allocate
from nemoh.engine.sampling import Sampling, sample
from nemoh.layers.attention import KVPages
from nemoh.layers.context import TokenContext
from nemoh.layers.mamba2 import MambaState
from nemoh.model import ModelParams, logits_from_hidden, run_layers


def initial_states(params: ModelParams, batch: int, num_pages: int, page_size: int) -> tuple:
    """Zero state per layer: MambaState for Mamba layers, a KV pool for attention, None otherwise."""
    cfg = params.config
    out = []
    for kind in cfg.layer_kinds:
        if kind == MAMBA:
            out.append(MambaState.zeros(cfg, batch, params.dtype))
        elif kind == ATTENTION:
            out.append(KVPages.zeros(cfg, num_pages, page_size, params.dtype))
        else:
            out.append(None)
    return tuple(out)


@partial(jax.jit, donate_argnums=(1, 2))
def _prefill_chunk(params: ModelParams, states: tuple, last_hidden: jax.Array, tokens: jax.Array,
                   ctx: TokenContext, lengths: jax.Array) -> tuple[tuple, jax.Array]:
    """One chunk [B, C]; keeps the hidden state of rows whose last real token is in this chunk."""
    h, states = run_layers(params, tokens, ctx, states)
    start = ctx.positions[:, 0]
    ends_here = (start < lengths) & (lengths <= start + tokens.shape[1])
    last_row = jnp.clip(ctx.valid_len - 1, 0, tokens.shape[1] - 1)
    row_h = jnp.take_along_axis(h, last_row[:, None, None], axis=1)[:, 0]
    return states, jnp.where(ends_here[:, None], row_h, last_hidden)


@partial(jax.jit, static_argnames=("sampling", "max_new_tokens"), donate_argnums=(1,))
def _first_token(params: ModelParams, states: tuple, last_hidden: jax.Array, lengths: jax.Array,
                 block_tables: jax.Array, rng: jax.Array, stop_ids: jax.Array, sampling: Sampling,
                 max_new_tokens: int) -> DecodeCarry:
    logits = logits_from_hidden(params, last_hidden)
    rng, key = jax.random.split(rng)
    tok = sample(logits, key, sampling)
    B = tok.shape[0]
    out = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(tok)
    finished = jnp.isin(tok, stop_ids) | (max_new_tokens <= 1)
    return DecodeCarry(tokens=tok, lengths=lengths, states=states, block_tables=block_tables,
                       finished=finished, rng=rng, out_tokens=out, num_generated=jnp.ones((B,), jnp.int32),
                       logits=logits, stop_ids=stop_ids)


def chunk_length(longest: int, prefill_chunk: int) -> int:
    """Chunk width: prefill_chunk, or the next power of two >= the longest prompt (min 16) if smaller.
    Bucketing to powers of two bounds the number of compiled shapes."""
    return min(prefill_chunk, max(16, 1 << (longest - 1).bit_length()))


def prefill(params: ModelParams, prompts: list[np.ndarray], *, max_new_tokens: int, sampling: Sampling,
            stop_ids: tuple[int, ...], seed: int, cache: CacheSpec, prefill_chunk: int = 256) -> DecodeCarry:
    """Run the prompts (already validated, non-empty) and sample each one's first new token."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    B = len(prompts)
    num_pages, tables = allocate(params.config, cache, [int(n) + max_new_tokens for n in lengths],
                                 jnp.dtype(params.dtype).itemsize)
    C = chunk_length(int(lengths.max()), prefill_chunk)
    n_chunks = -(-int(lengths.max()) // C)
    padded = np.zeros((B, n_chunks * C), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    states = initial_states(params, B, num_pages, cache.page_size)
    last_hidden = jnp.zeros((B, params.config.hidden_size), params.dtype)
    block_tables = jnp.asarray(tables)
    for c in range(n_chunks):
        start = c * C
        ctx = TokenContext(
            positions=jnp.asarray(np.broadcast_to(np.arange(start, start + C, dtype=np.int32), (B, C))),
            valid_len=jnp.asarray(np.clip(lengths - start, 0, C).astype(np.int32)),
            block_tables=block_tables,
        )
        states, last_hidden = _prefill_chunk(params, states, last_hidden, jnp.asarray(padded[:, start : start + C]), ctx,
                                              jnp.asarray(lengths))
    return _first_token(params, states, last_hidden, jnp.asarray(lengths), block_tables,
                        jax.random.PRNGKey(seed), jnp.asarray(stop_ids, jnp.int32).reshape(-1),
                        sampling=sampling, max_new_tokens=max_new_tokens)
