"""Params on a mesh: checked, then placed. Before any device work the rules' layout is checked (a mesh
axis that does not divide a dim it splits) and so are each layer kind's own needs of the mesh (Mamba
groups, attention's kv groups, the experts' split): one layer of each params type is traced on the
placement, abstractly, so nothing runs and the layers' own checks raise their MeshError.
"""

from __future__ import annotations

import functools

import jax

from nemoh import validate
from nemoh.layers.context import TokenContext
from nemoh.sharding.placement import Placement, make_placement, mesh_of, tracing
from nemoh.sharding.rules import BATCH


@functools.lru_cache(maxsize=32)
def _trace_layers(placement: Placement, cfg, dtype, layers: tuple) -> None:
    """One layer of each kind (abstract params) traced on the placement; nothing runs."""
    from nemoh.model import apply_mixer  # nemoh.model places its params through this module

    rows = placement.ways(BATCH)
    mixer = lambda layer, h: apply_mixer(layer, h, cfg, None, TokenContext.full(rows, 1, placement))[0]
    with tracing(placement):
        for layer in layers:
            jax.eval_shape(mixer, layer, jax.ShapeDtypeStruct((rows, 1, cfg.hidden_size), dtype))


def check_params(params, placement: Placement):
    """The params' shardings by the rules, after the checks (module docstring); MeshError names what
    does not fit. params: arrays, abstract values or deferred leaves. Checked once per placement and
    params structure and shapes (every sharded prefill and decode call asks again)."""
    leaves, treedef = jax.tree.flatten(params)
    return _checked_shardings(placement, treedef, tuple((tuple(a.shape), jax.numpy.dtype(a.dtype)) for a in leaves))


@functools.lru_cache(maxsize=32)
def _checked_shardings(placement: Placement, treedef, shapes: tuple):
    params = treedef.unflatten([jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes])
    shardings = placement.shardings(params)
    first = {}
    for layer in params.layers:
        first.setdefault(type(layer), layer)
    _trace_layers(placement, params.config, params.dtype, tuple(first.values()))
    return shardings


def resolve(params, mesh=None, rules=None):
    """(params, placement) of a call: `mesh` with `rules` (default DEFAULT_RULES), or without a mesh the
    mesh the params already live on; (params, None) for params on one device and no mesh. Params are
    checked (MeshError before any device work) and, when not yet on the placement's mesh, placed."""
    if mesh is None:
        mesh = mesh_of(params)
        if mesh is None:
            if rules is not None:
                validate.fail("rules", rules, "needs a mesh: pass mesh=... (or params placed on one)")
            return params, None
    placement = make_placement(mesh, rules)
    shardings = check_params(params, placement)
    if not placement.holds(params):
        params = jax.device_put(params, shardings)
    return params, placement


def shard_params(params, mesh, rules=None):
    """Params laid out on `mesh` by `rules` (default DEFAULT_RULES), e.g. params loaded on one device.
    MeshError (before any transfer) names the tensor, dim and mesh axis when an axis size does not
    divide a dim it splits, or what a layer kind needs of the mesh."""
    placement = make_placement(mesh, rules)
    return jax.device_put(params, check_params(params, placement))
