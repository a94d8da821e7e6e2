"""DecodeCarry: everything that crosses a decode step, as one explicit pytree.

It is consumed and returned by every step (donated under jit), so no stale copy of any of it can be
read: the next input token is produced on the device inside the step and read there by the next one.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nemoh.engine.sampling import SamplingState
from nemoh.errors import NonFiniteError, RequestError, StaleCarryError
from nemoh.layers.protocol import StateShape, check_layer
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
    padding). sampling: per-row settings and keys. state_shape (static): what the layer states were
    made for (batch slots, KV pool pages, page size, dtype). placement (static): the mesh and rules the
    carry is laid out by (nemoh.sharding), None on one device; decode keeps that layout.
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
    state_shape: StateShape = dataclasses.field(metadata=dict(static=True))
    placement: Placement | None = dataclasses.field(default=None, metadata=dict(static=True))


def initial_states(params: ModelParams, shape: StateShape) -> tuple:
    """Each layer's zero carried state for `shape` (what its init_state makes), one entry per layer;
    LayerError for a layer that does not follow the protocol."""
    for i, layer in enumerate(params.layers):
        check_layer(i, layer)
    return tuple(layer.init_state(params.config, shape) for layer in params.layers)


@dataclasses.dataclass(frozen=True)
class StateCosts:
    """Bytes of all layers' carried states: per batch slot (Mamba windows and states, user states) and
    per KV page (every attention layer's K and V)."""

    per_row: int
    per_page: int


def state_costs(params: ModelParams, page_size: int) -> StateCosts:
    """Read off the layers' init_state at two batch sizes and two pool sizes (shapes only, no memory),
    each traced once (_specs_for): tracing all layers' init_state three times took ~13 ms of host time
    at 52 layers, which each prefill call spent before the device started."""
    specs = _specs_for(params)

    def total(batch: int, pages: int) -> int:
        layers = specs(StateShape(batch, pages, page_size, jnp.dtype(params.dtype)))
        return sum(math.prod(shape) * dtype.itemsize for spec in layers for shape, dtype in spec.leaves)

    base = total(1, 1)
    return StateCosts(per_row=total(2, 1) - base, per_page=total(1, 2) - base)


def check_live(carry: DecodeCarry) -> None:
    """Raise StaleCarryError when any buffer of `carry` was already consumed by a step."""
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(carry) if isinstance(leaf, jax.Array)):
        raise StaleCarryError(
            "this DecodeCarry was already consumed by a decode step (its buffers were donated); "
            "use the carry that step returned"
        )


@dataclasses.dataclass(frozen=True)
class _Spec:
    """A layer state's tree structure and leaves' (shape, dtype); `name` only labels it in messages."""

    tree: Any
    leaves: tuple
    name: str = dataclasses.field(compare=False)

    def __str__(self) -> str:
        return f"{self.name}({', '.join(f'{d}{list(s)}' for s, d in self.leaves)})"


def _spec(state) -> _Spec:
    tree = jax.tree.structure(state)
    name = "array" if jax.tree_util.treedef_is_leaf(tree) and state is not None else type(state).__name__
    return _Spec(tree, tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in jax.tree.leaves(state)), name)


def shapes_key(tree) -> tuple:
    """A hashable key of a pytree's structure and its leaves' shapes and dtypes (what traced shapes and
    compiled programs depend on, not the values)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((a.shape, a.dtype) for a in leaves)


_EXPECTED: dict = {}  # layers' structure, leaf shapes and config -> {StateShape: expected state specs}


def _specs_for(params: ModelParams):
    """shape -> the state specs (_Spec per layer) params' layers make for that StateShape, each traced
    once. Kept per what the states follow from (prefill makes them inside a jitted program, from traced
    params): the layers' structure and leaf shapes, and the config."""
    key = (shapes_key(params.layers), params.config)
    by_shape = _EXPECTED.get(key)
    if by_shape is None:
        if len(_EXPECTED) > 16:
            _EXPECTED.clear()
        by_shape = _EXPECTED[key] = {}

    def specs(shape: StateShape) -> tuple:
        if shape not in by_shape:
            if len(by_shape) > 64:
                by_shape.clear()
            by_shape[shape] = tuple(_spec(s) for s in jax.eval_shape(lambda: initial_states(params, shape)))
        return by_shape[shape]

    return specs


def abstract_states(params: ModelParams, shape: StateShape) -> tuple:
    """initial_states(params, shape) as shapes and dtypes (jax.ShapeDtypeStruct leaves), from _specs_for's
    cache: what a sharded request checks its carry's layout against without tracing the layers again."""
    return tuple(spec.tree.unflatten([jax.ShapeDtypeStruct(s, d) for s, d in spec.leaves])
                 for spec in _specs_for(params)(shape))


def check_matches(params: ModelParams, carry: DecodeCarry) -> None:
    """RequestError unless carry's states have the structure, shapes and dtypes `params` would give
    them (e.g. a float32 carry with bfloat16 params, or a carry from another model). A (params, carry
    layout) pair that passed is remembered while params live: decode checks every call, and walking
    the params' thousand-odd leaves each time cost milliseconds of host time before each launch."""
    layout = _carry_layout(carry)
    passed = _MATCHED.get(id(params))
    if passed is not None and passed[0]() is params and layout in passed[1]:
        return
    want = _specs_for(params)(dataclasses.replace(carry.state_shape, dtype=jnp.dtype(params.dtype)))
    got = tuple(_spec(s) for s in carry.states)
    if len(got) != len(want):
        raise RequestError(f"carry does not match params: {len(got)} layer states, the model has {len(want)} layers")
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise RequestError(f"carry does not match params: layer {i} state is {g}, but these params "
                               f"({params.dtype}) need {w}")
    if carry.logits.shape[-1] != params.config.vocab_size:
        raise RequestError(f"carry does not match params: logits over {carry.logits.shape[-1]} tokens, the "
                           f"vocabulary has {params.config.vocab_size}")
    if passed is None or passed[0]() is not params:
        passed = _MATCHED[id(params)] = (weakref.ref(params, lambda _, key=id(params): _MATCHED.pop(key, None)), set())
    passed[1].add(layout)


_MATCHED: dict = {}  # id(params) -> (weak reference to them, carry layouts that matched them)


def _carry_layout(carry: DecodeCarry) -> tuple:
    """What check_matches compares, as a hashable key: the states' structure, leaf shapes and dtypes,
    the logits width and the static state shape."""
    return shapes_key(carry.states), carry.logits.shape[-1], carry.state_shape


def raise_if_nonfinite(carry: DecodeCarry) -> None:
    """NonFiniteError naming the slots whose logits were NaN/Inf (one small device read per call)."""
    bad = np.flatnonzero(to_host(carry.nonfinite))
    if bad.size:
        counts = to_host(carry.num_generated)
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
