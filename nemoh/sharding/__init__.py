"""Sharded models over a jax Mesh: rules as data (rules), placing params and carries on a mesh
(placement), and what each layer runs per device (local; the layers' sharded paths use it).
See docs/multi_gpu.md."""

from nemoh.sharding.params import shard_params
from nemoh.sharding.placement import Placement
from nemoh.sharding.rules import DEFAULT_LEAF_AXES, DEFAULT_MESH_AXES, DEFAULT_RULES, Rules

__all__ = ["Rules", "DEFAULT_RULES", "DEFAULT_LEAF_AXES", "DEFAULT_MESH_AXES", "Placement", "shard_params"]
