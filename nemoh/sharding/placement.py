"""Placement: a device mesh and the rules that lay params and carries out on it, and the calls that
use them (place a tree, constrain one inside a compiled program, pick the placement of a call).

Programs run with XLA's automatic partitioning (GSPMD) over the placed arrays; each layer kind runs
its own part in shard_map (nemoh.sharding.local). A Placement is frozen and hashable: it is a static
value of the compiled programs (a field of TokenContext, PrefillInputs and DecodeCarry), so a program
is compiled once per mesh and rules.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding

from nemoh import validate
from nemoh.errors import MeshError
from nemoh.sharding.rules import BATCH, DEFAULT_RULES, EXPERT_IN, HIDDEN, LATENT, PAGES, Rules, tree_specs

WHOLE = (HIDDEN, EXPERT_IN, LATENT)  # logical axes the layers take whole on every device


def auto_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with every axis automatic (XLA partitions the programs; jax.make_mesh makes explicit axes)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@dataclasses.dataclass(frozen=True)
class Placement:
    """mesh: the devices (automatic axes); rules: the logical-axis tables (nemoh.sharding.rules)."""

    mesh: Mesh
    rules: Rules = DEFAULT_RULES

    def __repr__(self) -> str:
        return f"Placement(mesh {dict(self.mesh.shape)}, {self.rules!r})"

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def axes(self, logical: str) -> tuple[str, ...]:
        """The mesh axes (of size > 1) that a logical axis splits over."""
        return self.rules.mesh_axes_of(logical, self.mesh_shape)

    def ways(self, logical: str) -> int:
        """Into how many parts the logical axis is split."""
        return int(np.prod([self.mesh.shape[n] for n in self.axes(logical)], dtype=np.int64))

    def specs(self, tree, where: str = "", axes: tuple | None = None):
        """PartitionSpec per array leaf of `tree` (MeshError for a dim its mesh axis does not divide);
        where, axes: the name and logical axes of `tree` when it is one field's value."""
        return tree_specs(tree, self.rules, self.mesh_shape, where, axes)

    def shardings(self, tree):
        """NamedSharding per array leaf of `tree`."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs(tree))

    def place(self, tree):
        """`tree` on the mesh by the rules (host arrays are split as they are sent)."""
        return jax.device_put(tree, self.shardings(tree))

    def holds(self, tree) -> bool:
        """Whether every array leaf of `tree` already lives on this mesh (any layout)."""
        return all(isinstance(a.sharding, NamedSharding) and a.sharding.mesh == self.mesh for a in _arrays(tree))


def constrain(tree, placement: Placement | None):
    """Inside a compiled program: pin `tree`'s leaves to the rules' layout (no-op without a placement)."""
    if placement is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, placement.shardings(tree))


def tracing(placement: Placement | None):
    """The context a sharded program is traced in: its mesh as the abstract mesh, so that ops know
    XLA partitions them (pallas_kernels then leaves custom kernels to shard_map bodies)."""
    if placement is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(placement.mesh.abstract_mesh)


def batch_shards(placement: Placement | None) -> int:
    """Into how many parts the batch (and with it the KV page pool) is split."""
    return 1 if placement is None else placement.ways(BATCH)


def _arrays(tree) -> list[jax.Array]:
    """The concrete device arrays among `tree`'s leaves (not tracers: inside an outer jit there are none)."""
    return [a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)]


def mesh_of(tree) -> Mesh | None:
    """The mesh the first array leaf of `tree` is laid out on (None for a single-device array)."""
    leaf = next(iter(_arrays(tree)), None)
    sharding = getattr(leaf, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def make_placement(mesh, rules) -> Placement:
    """Checked arguments -> Placement (RequestError naming a bad mesh or rules; MeshError for rules
    that split what the layers take whole on every device)."""
    validate.instance("mesh", mesh, Mesh, "a jax.sharding.Mesh (e.g. jax.make_mesh((4, 2), ('expert', 'tensor')))")
    rules = DEFAULT_RULES if rules is None else validate.instance("rules", rules, Rules, "nemoh.sharding.Rules")
    placement = Placement(auto_mesh(mesh), rules)
    for logical in WHOLE:
        if placement.axes(logical):
            raise MeshError(f"rules: {logical!r} splits over mesh axes {placement.axes(logical)}, but every layer "
                            f"takes it whole on each device; map it to None")
    if placement.axes(PAGES) != placement.axes(BATCH):
        raise MeshError(f"rules: the KV pages split over {placement.axes(PAGES)} but the batch over "
                        f"{placement.axes(BATCH)}; a batch shard's pages must live with its rows")
    return placement


def to_host(x) -> np.ndarray:
    """A device array as numpy, also when its shards live on several hosts (gathered from all of them)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
