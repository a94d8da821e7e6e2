"""The layer protocol: what an entry of `params.layers` is.

A layer is a pytree (e.g. a jax.tree_util.register_dataclass dataclass) that carries its behaviour:

    norm                              [H] weight of the RMSNorm applied before the mixer
    mix(h, cfg, state, ctx)           normed h [b, T, H] -> (out [b, T, H], new state); `state` is what
                                      init_state made (threaded through prefill and decode), or None in a
                                      stateless full-sequence forward; ctx: the TokenContext (positions,
                                      valid lengths, KV block tables)
    init_state(cfg, shape)            the zero carried state for `shape` (batch slots, KV pool pages and
                                      page size, model dtype): a pytree of arrays, or None

The model and the engine ask each layer, so a replacement layer of a new type, stateful or not, needs
no change inside nemoh. Built-in layers (Mamba2, attention, MLP, MoE) follow the same protocol, and
declare the Hugging Face layer kind they are (HF_KIND) so that checkpoints can be written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

from nemoh.errors import LayerError


@dataclasses.dataclass(frozen=True)
class StateShape:
    """What carried states are sized by: batch slots, KV pool pages, tokens a page, the model dtype."""

    batch: int
    num_pages: int
    page_size: int
    dtype: Any


@runtime_checkable
class Layer(Protocol):
    norm: jax.Array

    def mix(self, h: jax.Array, cfg, state, ctx) -> tuple[jax.Array, Any]: ...

    def init_state(self, cfg, shape: StateShape) -> Any: ...


class Stateless:
    """Mixin for layers that carry nothing between steps."""

    def init_state(self, cfg, shape: StateShape) -> None:
        return None


def check_layer(index: int, layer) -> None:
    """LayerError naming the layer unless it has a `norm`, a callable `mix` and a callable `init_state`."""
    missing = [name for name in ("norm", "mix", "init_state")
               if not hasattr(layer, name) or (name != "norm" and not callable(getattr(layer, name)))]
    if missing:
        raise LayerError(f"layer {index} ({type(layer).__name__}) does not follow the layer protocol: no "
                         f"{', '.join(missing)} (see nemoh.layers.protocol)")


def check_state(index: int, layer, given, returned) -> None:
    """LayerError naming the layer when its mixer returned a state of another structure, shape or dtype
    than the one it was given (the carry's layout must not change between steps)."""
    spec = lambda s: (jax.tree.structure(s), [(getattr(a, "shape", None), getattr(a, "dtype", None))
                                              for a in jax.tree.leaves(s)])
    if spec(given) != spec(returned):
        raise LayerError(f"layer {index} ({type(layer).__name__}): its mixer returned a state of another "
                         f"structure than it was given: {jax.tree.structure(returned)} instead of "
                         f"{jax.tree.structure(given)}")
