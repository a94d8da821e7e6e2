"""What a layer runs per device under a mesh: shard_map over the placement's mesh, the specs of its
activations, and the collectives that join the per-device parts.

Each layer kind runs its own part on its own shards (Megatron-style: heads, widths and experts split,
activations whole) and one psum in fp32 adds the parts; XLA partitions only what lies between layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nemoh.sharding.placement import Placement
from nemoh.sharding.rules import BATCH, PAGES


def fit_rows(placement: Placement, rows: int) -> Placement:
    """The placement for a block of `rows` batch rows: as given, or with the batch (and the KV pages)
    whole on every device when the rows do not split evenly over its mesh axes (e.g. one prompt)."""
    if rows % placement.ways(BATCH) == 0:
        return placement
    return dataclasses.replace(placement, rules=placement.rules.with_mesh_axes(**{BATCH: None, PAGES: None}))


def rows_spec(axes: tuple[str, ...], ndim: int) -> P:
    """Spec of an activation whose leading dim is the batch (or token) rows, split over `axes`."""
    return P(axes or None, *(None,) * (ndim - 1))


def per_device(placement: Placement, fn, in_specs, out_specs):
    """fn run on every device of the placement's mesh on its own shards (all mesh axes manual)."""
    return jax.shard_map(fn, mesh=placement.mesh, in_specs=in_specs, out_specs=out_specs)


def axis_position(axes: tuple[str, ...]):
    """This device's index along `axes` (row-major over them, as NamedSharding splits a dim); 0 for none."""
    return jax.lax.axis_index(axes) if axes else 0


def psum32(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sum of the per-device parts x over `axes`, added in fp32, in x.dtype."""
    if not axes:
        return x
    return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)


def first_only(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """x on the devices at index 0 along `axes`, zeros elsewhere: a part that is the same on every
    device of those axes then enters a psum over them once."""
    if not axes:
        return x
    return jnp.where(axis_position(axes) == 0, x, jnp.zeros_like(x))
