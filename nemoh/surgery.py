"""Model surgery: new params with layers selected, replaced, dropped or inserted (the old params are
left untouched).

`where` selects layers by: an index, a slice, a sequence of indices, a kind name (the layer's named
scope, nemoh.model.layer_scope: "mamba", "attention", "moe", "mlp", or a user type's lower-cased name
without "Params"), a type (isinstance), or a predicate(index, layer) -> bool.

The config follows the surgery when every layer is a built-in kind (its layer pattern is rewritten, so
save_hf writes the new model); with layers of user types it keeps describing the model as loaded.
penzai's `pz.select(params).at_instances_of(T).apply(f)` works on the same params too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from nemoh.errors import RequestError
from nemoh.layers.protocol import check_layer
from nemoh.model import ModelParams, layer_scope

Selector = int | slice | Sequence[int] | str | type | Callable[[int, Any], bool]


def select(params: ModelParams, where: Selector) -> list[int]:
    """Indices of the layers `where` picks, in order."""
    n = len(params.layers)
    if isinstance(where, bool):
        raise RequestError(f"where={where!r}: a layer selector, not a bool")
    if isinstance(where, int):
        if not -n <= where < n:
            raise RequestError(f"where={where}: the model has {n} layers")
        return [where % n]
    if isinstance(where, slice):
        return list(range(n))[where]
    if isinstance(where, str):
        return [i for i, layer in enumerate(params.layers) if layer_scope(layer) == where]
    if isinstance(where, type):
        return [i for i, layer in enumerate(params.layers) if isinstance(layer, where)]
    if callable(where):
        return [i for i, layer in enumerate(params.layers) if where(i, layer)]
    indices = list(where)
    for i in indices:
        select(params, i)
    return [i % n for i in indices]


def _with_layers(params: ModelParams, layers: list) -> ModelParams:
    for i, layer in enumerate(layers):
        check_layer(i, layer)
    config = params.config
    kinds = [getattr(type(layer), "HF_KIND", None) for layer in layers]
    if None not in kinds:
        config = dataclasses.replace(config, layer_kinds=tuple(kinds))
    return dataclasses.replace(params, config=config, layers=tuple(layers))


def replace(params: ModelParams, where: Selector, new) -> ModelParams:
    """Params with each selected layer replaced by `new` (a layer, or new(index, old layer) -> layer)."""
    layers = list(params.layers)
    for i in select(params, where):
        layers[i] = new(i, layers[i]) if callable(new) and not hasattr(new, "mix") else new
    return _with_layers(params, layers)


def drop(params: ModelParams, where: Selector) -> ModelParams:
    """Params without the selected layers."""
    gone = set(select(params, where))
    if len(gone) == len(params.layers):
        raise RequestError("drop: that would leave no layers")
    return _with_layers(params, [layer for i, layer in enumerate(params.layers) if i not in gone])


def insert(params: ModelParams, index: int, layer) -> ModelParams:
    """Params with `layer` inserted before position `index` (len(layers) appends)."""
    n = len(params.layers)
    if isinstance(index, bool) or not isinstance(index, int) or not -n <= index <= n:
        raise RequestError(f"index={index!r}: must be an integer in [{-n}, {n}]")
    layers = list(params.layers)
    layers.insert(index, layer)
    return _with_layers(params, layers)
