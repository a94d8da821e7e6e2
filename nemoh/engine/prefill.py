"""Prefill: a ragged batch of prompts through the model in chunks, building the decode carry.

One compiled program per layout (see layout.py): the prompts sit right-padded in the carry's
`sequences` buffer; a loop on the device runs as many chunks as the longest prompt needs, threading
the states through, padding rows masked (no KV write, no Mamba state change), and keeps each
sequence's last real hidden state; then the first new token is sampled.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from nemoh import validate
from nemoh.engine import xla_options
from nemoh.engine.carry import (DecodeCarry, abstract_states, initial_states, raise_if_nonfinite, shapes_key,
                                state_costs)
from nemoh.engine.decode import compile_ahead
from nemoh.engine.kv_pages import CacheSpec, block_tables
from nemoh.engine.layout import MAX_ROW_TOKENS, Layout, plan
from nemoh.engine.sampling import Sampling, SamplingState, sample, sampling_state
from nemoh.layers.context import TokenContext
from nemoh.layers.protocol import StateShape
from nemoh.model import ModelParams, logits_from_hidden, run_layers
from nemoh.sharding.params import resolve
from nemoh.sharding.placement import Placement, batch_shards, constrain, tracing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """Host-built inputs for `rows` slots: sequences [rows, T] int32 (prompts, right-padded);
    lengths, max_new [rows] int32 (0 for dummy rows); block_tables [rows, P] int32; stop_ids [S] int32;
    sampling: each row's settings and random stream (SamplingState); placement (static): the mesh and
    rules of a sharded prefill, None on one device."""

    sequences: jax.Array
    lengths: jax.Array
    max_new: jax.Array
    block_tables: jax.Array
    stop_ids: jax.Array
    sampling: SamplingState
    placement: Placement | None = dataclasses.field(default=None, metadata=dict(static=True))


@partial(jax.jit, static_argnames=("chunk", "num_pages", "page_size"), donate_argnums=(1,),
         compiler_options=xla_options.ENGINE)
def _prefill(params: ModelParams, x: PrefillInputs, chunk: int, num_pages: int, page_size: int) -> DecodeCarry:
    rows = x.lengths.shape[0]
    positions = jnp.arange(chunk, dtype=jnp.int32)[None, :]

    def run_chunk(c, state):
        states, last_hidden = state
        start = c * chunk
        valid = jnp.clip(x.lengths - start, 0, chunk)
        ctx = TokenContext(positions=jnp.broadcast_to(start + positions, (rows, chunk)), valid_len=valid,
                           block_tables=x.block_tables, placement=x.placement)
        h, states = run_layers(params, jax.lax.dynamic_slice_in_dim(x.sequences, start, chunk, axis=1), ctx, states)
        row_h = jnp.take_along_axis(h, jnp.clip(valid - 1, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        ends_here = (valid > 0) & (x.lengths <= start + chunk)
        return constrain(states, x.placement), jnp.where(ends_here[:, None], row_h, last_hidden)

    n_chunks = (jnp.max(x.lengths) + chunk - 1) // chunk
    state_shape = StateShape(rows, num_pages, page_size, jnp.dtype(params.dtype))
    start_state = (constrain(initial_states(params, state_shape), x.placement),
                   jnp.zeros((rows, params.config.hidden_size), params.dtype))
    with tracing(x.placement):
        states, last_hidden = jax.lax.fori_loop(0, n_chunks, run_chunk, start_state)
        logits = logits_from_hidden(params, last_hidden)
    real = x.lengths > 0
    tok = sample(logits, x.sampling, jnp.zeros_like(x.lengths))
    nonfinite = real & ~jnp.all(jnp.isfinite(logits), axis=-1)
    at = jnp.where(real, x.lengths, x.sequences.shape[1])  # dummy rows write nothing
    num_generated = real.astype(jnp.int32)
    return constrain(DecodeCarry(
        tokens=tok, lengths=x.lengths, states=states, block_tables=x.block_tables,
        sequences=x.sequences.at[jnp.arange(rows), at].set(tok, mode="drop"),
        num_generated=num_generated, max_new=x.max_new,
        finished=~real | jnp.isin(tok, x.stop_ids) | (num_generated >= x.max_new) | nonfinite,
        nonfinite=nonfinite, logits=logits, stop_ids=x.stop_ids, sampling=x.sampling, state_shape=state_shape,
        placement=x.placement,
    ), x.placement)


def _inputs(prompts: list[np.ndarray], lay: Layout, max_new_tokens: int, stop_ids: tuple[int, ...],
            sampling: SamplingState) -> PrefillInputs:
    n = len(prompts)
    budgets = [len(p) + max_new_tokens for p in prompts]
    sequences = np.zeros((lay.rows, lay.row_tokens), np.int32)
    for i, p in enumerate(prompts):
        sequences[i, : len(p)] = p
    stops = np.full(lay.stop_slots, -1, np.int32)
    stops[: len(stop_ids)] = stop_ids
    pad = [0] * (lay.rows - n)
    return PrefillInputs(
        sequences=sequences,
        lengths=np.array([len(p) for p in prompts] + pad, np.int32),
        max_new=np.array([max_new_tokens] * n + pad, np.int32),
        block_tables=block_tables(budgets, lay.page_size, lay.rows, lay.pages_per_row, lay.shards),
        stop_ids=stops,
        sampling=sampling,
    )


def prefill(params: ModelParams, prompts, *, max_new_tokens: int, sampling: Sampling = Sampling(),
            stop_ids=(), seed=0, cache: CacheSpec = CacheSpec(), prefill_chunk: int | None = None, mesh=None,
            rules=None) -> DecodeCarry:
    """Run the prompts and sample each one's first new token; returns the carry for `decode`.

    prompts: as generate takes them. sampling: one Sampling (values per prompt or for all); seed: an
    integer for every prompt or a list of one per prompt (any size, used whole); stop_ids: token ids
    that end a sequence. prefill_chunk: prompt tokens per row per chunk (None: on a GPU about 2048
    across the batch slots, else 256; engine.layout.chunk_width). mesh, rules: run sharded, the carry
    laid out by the rules (nemoh.sharding; params already on a mesh run on it without them); batch slots
    and KV pages then come in multiples of the ways the batch is split. Every argument is checked
    (RequestError, MeshError) and the request's memory need (CacheCapacityError) before any device work;
    NaN/Inf logits raise NonFiniteError. When tokens remain to decode, the decode program for this
    carry starts compiling beside prefill (engine.decode.compile_ahead).
    """
    params, x, static = prefill_program(params, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                        stop_ids=stop_ids, seed=seed, cache=cache, prefill_chunk=prefill_chunk,
                                        mesh=mesh, rules=rules)
    if max_new_tokens > 1:
        _compile_decode_ahead(params, x, static)
    carry = _prefill(params, x, **static)
    raise_if_nonfinite(carry)
    return carry


_AHEAD_STARTED: set = set()  # (params and inputs: structure, leaf shapes and dtypes; static args; device)


def _compile_decode_ahead(params: ModelParams, x: PrefillInputs, static: dict) -> None:
    """Start compiling the decode program for the carry this prefill will return, once per shape (a
    repeat costs ~1 ms of key building). Prefill is traced and lowered first, here (the call reuses
    that lowering): the worker's Python work then overlaps prefill's XLA compile, which holds no GIL,
    rather than prefill's own tracing."""
    device = next(iter(params.embed.devices()))
    key = (shapes_key((params, x)), tuple(sorted(static.items())), device)
    if key in _AHEAD_STARTED:
        return
    if len(_AHEAD_STARTED) > 64:
        _AHEAD_STARTED.clear()
    _AHEAD_STARTED.add(key)
    shape = _prefill.lower(params, x, **static).out_info
    if x.placement is None:
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shape)
    else:  # the layout prefill pins its carry to
        shardings = x.placement.shardings(shape)
    compile_ahead(params, jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                                       shape, shardings))


def prefill_program(params: ModelParams, prompts, *, max_new_tokens: int, sampling: Sampling, stop_ids, seed,
                    cache: CacheSpec, prefill_chunk: int | None, mesh, rules
                    ) -> tuple[ModelParams, PrefillInputs, dict]:
    """The checked arguments of prefill's compiled program: (params, inputs, static keyword arguments),
    so `_prefill(*...)` runs it and `_prefill.lower(...)` shows it (benchmarks). The inputs are host
    arrays, sent by the call, or on a sharded request's mesh."""
    validate.instance("params", params, ModelParams, "ModelParams (from nemoh.load)")
    cfg = params.config
    prompts = validate.prompt_list(prompts, cfg.vocab_size)
    longest = max(len(p) for p in prompts)
    max_new_tokens = validate.integer("max_new_tokens", max_new_tokens, 1, MAX_ROW_TOKENS - longest)
    validate.instance("sampling", sampling, Sampling, "a Sampling")
    stop_ids = tuple(dict.fromkeys(validate.token_id_list("stop_ids", stop_ids, cfg.vocab_size)))
    seeds = validate.per_row("seed", seed, len(prompts), validate.seed)
    validate.instance("cache", cache, CacheSpec, "a CacheSpec")
    if prefill_chunk is not None:
        prefill_chunk = validate.integer("prefill_chunk", prefill_chunk, 1, MAX_ROW_TOKENS)
    params, placement = resolve(params, mesh, rules)
    lay = plan(cfg, state_costs(params, cache.page_size), [len(p) for p in prompts], max_new_tokens, cache,
               prefill_chunk, len(stop_ids), next(iter(params.embed.devices())), batch_shards(placement))
    state = sampling_state(sampling, seeds, prompts, cfg.vocab_size, lay.rows)
    x = dataclasses.replace(_inputs(prompts, lay, max_new_tokens, stop_ids, state), placement=placement)
    # On one device the inputs stay host arrays: the call sends them in its own dispatch, without a
    # device_put a leaf (~0.1 ms each of Python on the host, nine leaves a call)
    if placement is not None:  # the carry's layout is checked (MeshError) before anything is sent
        shape = StateShape(lay.rows, lay.num_pages, lay.page_size, jnp.dtype(params.dtype))
        placement.specs(abstract_states(params, shape), "carry.states")
        x = placement.place(x)
    return params, x, dict(chunk=lay.chunk, num_pages=lay.num_pages, page_size=lay.page_size)
