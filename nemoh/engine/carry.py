"""DecodeCarry: everything that crosses a decode step, as one explicit pytree.

It is consumed and returned by every step (donated under jit), so no stale copy of any of it can be
read: the next input token is produced on the device inside the step and read there by the next one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nemoh.config import ATTENTION, MAMBA, NemotronHConfig
from nemoh.engine.sampling import SamplingState
from nemoh.errors import NonFiniteError, RequestError, StaleCarryError
from nemoh.layers.attention import KVPages
from nemoh.layers.mamba2 import MambaState
from nemoh.model import ModelParams
from nemoh.sharding.placement import Placement, to_host


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCarry:
    """B sequence slots (the prompts first, then finished dummy rows).

    tokens [B] int32: the last sampled token, the next step's input. lengths [B] int32: tokens already
    in the cache (= position of `tokens`). states: one entry per layer: MambaState (conv window, fp32
    SSM state), KVPages (the layer's page pool) or None. block_tables [B, P] int32: each slot's pages.
    sequences [B, T] int32: each slot's prompt followed by its num_generated [B] new tokens (the newest
    is `tokens`); max_new [B] int32. finished [B] bool. nonfinite [B] bool: the slot met NaN/Inf
    logits. logits [B, V] fp32: the distribution `tokens` was sampled from. stop_ids [S] int32 (-1 is
    padding). sampling: per-row settings and keys. placement (static): the mesh and rules the carry is
    laid out by (nemoh.sharding), None on one device; decode keeps that layout.
    """

    tokens: jax.Array
    lengths: jax.Array
    states: tuple
    block_tables: jax.Array
    sequences: jax.Array
    num_generated: jax.Array
    max_new: jax.Array
    finished: jax.Array
    nonfinite: jax.Array
    logits: jax.Array
    stop_ids: jax.Array
    sampling: SamplingState
    placement: Placement | None = dataclasses.field(default=None, metadata=dict(static=True))


def initial_states(cfg: NemotronHConfig, dtype, batch: int, num_pages: int, page_size: int) -> tuple:
    """Zero state per layer: MambaState for Mamba layers, a KV pool for attention, None otherwise."""
    out = []
    for kind in cfg.layer_kinds:
        if kind == MAMBA:
            out.append(MambaState.zeros(cfg, batch, dtype))
        elif kind == ATTENTION:
            out.append(KVPages.zeros(cfg, num_pages, page_size, dtype))
        else:
            out.append(None)
    return tuple(out)


def check_live(carry: DecodeCarry) -> None:
    """Raise StaleCarryError when any buffer of `carry` was already consumed by a step."""
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(carry) if isinstance(leaf, jax.Array)):
        raise StaleCarryError(
            "this DecodeCarry was already consumed by a decode step (its buffers were donated); "
            "use the carry that step returned"
        )


def _spec(state) -> tuple:
    """A layer state's type and its leaves' (shape, dtype)."""
    return type(state).__name__, tuple((tuple(a.shape), a.dtype) for a in jax.tree.leaves(state))


@functools.lru_cache(maxsize=16)
def _expected(cfg: NemotronHConfig, dtype, batch: int, num_pages: int, page_size: int) -> tuple:
    return tuple(_spec(s) for s in jax.eval_shape(lambda: initial_states(cfg, dtype, batch, num_pages, page_size)))


def check_matches(params: ModelParams, carry: DecodeCarry) -> None:
    """RequestError unless carry's states have the structure, shapes and dtypes `params` would give
    them (e.g. a float32 carry with bfloat16 params, or a carry from another model)."""
    pools = [s for s in carry.states if isinstance(s, KVPages)]
    num_pages, page_size = pools[0].k.shape[:2] if pools else (1, 1)
    want = _expected(params.config, jnp.dtype(params.dtype), carry.tokens.shape[0], num_pages, page_size)
    got = tuple(_spec(s) for s in carry.states)
    if len(got) != len(want):
        raise RequestError(f"carry does not match params: {len(got)} layer states, the model has {len(want)} layers")
    show = lambda spec: f"{spec[0]}({', '.join(f'{d}{list(s)}' for s, d in spec[1])})"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise RequestError(f"carry does not match params: layer {i} state is {show(g)}, but these params "
                               f"({params.dtype}) need {show(w)}")
    if carry.logits.shape[-1] != params.config.vocab_size:
        raise RequestError(f"carry does not match params: logits over {carry.logits.shape[-1]} tokens, the "
                           f"vocabulary has {params.config.vocab_size}")


def raise_if_nonfinite(carry: DecodeCarry) -> None:
    """NonFiniteError naming the slots whose logits were NaN/Inf (one small device read per call)."""
    flags, counts = to_host(carry.nonfinite), to_host(carry.num_generated)
    bad = np.flatnonzero(flags)
    if bad.size:
        raise NonFiniteError(
            f"non-finite logits (NaN or Inf) for prompt(s) {bad.tolist()} while sampling new token(s) "
            f"{np.asarray(counts)[bad].tolist()}: the weights or activations overflowed; no tokens are "
            "returned from them"
        )


def consume(carry: DecodeCarry) -> None:
    """Delete what donation left behind (backends that do not donate), so reuse fails on every backend."""
    for leaf in jax.tree.leaves(carry):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
