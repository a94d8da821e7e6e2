"""Sharding rules as data: the logical axes of every param and carry leaf, and the mesh axis that each
logical axis is split over.

A Rules holds two tables:
  leaf_axes  {type name: {field: logical axes, one per dim (None: never split)}}. For a projection field
             they are the axes of the logical weight [..., out, in]; an FP8Weight's or NVFP4Weight's
             stored leaves follow them through the format's LEAF_DIMS (NVFP4's transposed block scales
             split along the same logical dims as its codes; the per-tensor scales along the experts).
  mesh_axes  {logical axis: a mesh axis name, a tuple of names, or None (replicated)}.
A leaf whose type or field is not in leaf_axes is replicated, and so is a dim whose mesh axes the mesh
lacks (or has of size 1): one table serves every mesh. Tuples in the tree (layers, carry states) are
walked into; types are named by their class name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

from jax.sharding import PartitionSpec

from nemoh.errors import MeshError
from pallas_kernels import is_quantized

# logical axes
BATCH = "batch"            # sequence slots of the carry and of token blocks
PAGES = "pages"            # the KV page pool
VOCAB = "vocab"
HIDDEN = "hidden"
MAMBA_IN = "mamba_in"      # in_proj's input dim (the hidden size: in_proj is row parallel)
MAMBA_CONV = "mamba_conv"  # conv window channels (x, B, C) in the carry
MAMBA_HEADS = "mamba_heads"
MAMBA_INNER = "mamba_inner"  # heads x head_dim (the gated norm, out_proj's input)
Q_HEADS = "q_heads"        # query heads x head_dim
KV_HEADS = "kv_heads"
MLP = "mlp"                # dense MLP width
EXPERTS = "experts"        # routed experts (the stacked leading dim)
EXPERT_MLP = "expert_mlp"  # routed expert width
EXPERT_IN = "expert_in"    # what a routed expert reads (hidden or latent): never split
SHARED_MLP = "shared_mlp"  # shared expert width
LATENT = "latent"

_NORM = {"norm": (HIDDEN,)}
_BATCH_VECTORS = ("tokens", "lengths", "num_generated", "max_new", "finished", "nonfinite")

DEFAULT_LEAF_AXES: dict[str, dict[str, tuple]] = {
    "ModelParams": {"embed": (VOCAB, HIDDEN), "norm_f": (HIDDEN,), "lm_head": (VOCAB, HIDDEN)},
    "MambaParams": {**_NORM, "in_proj": (None, MAMBA_IN), "conv_weight": (None, None),
                    "conv_bias": (None,), "A_log": (MAMBA_HEADS,), "D": (MAMBA_HEADS,),
                    "dt_bias": (MAMBA_HEADS,), "gate_norm": (MAMBA_INNER,), "out_proj": (HIDDEN, MAMBA_INNER)},
    "AttentionParams": {**_NORM, "q_proj": (Q_HEADS, HIDDEN), "k_proj": (KV_HEADS, HIDDEN),
                        "v_proj": (KV_HEADS, HIDDEN), "o_proj": (HIDDEN, Q_HEADS)},
    "MLPParams": {**_NORM, "up_proj": (MLP, HIDDEN), "down_proj": (HIDDEN, MLP)},
    "MoEParams": {**_NORM, "router": (None, HIDDEN), "router_bias": (None,),
                  "experts_up": (EXPERTS, EXPERT_MLP, EXPERT_IN), "experts_down": (EXPERTS, EXPERT_IN, EXPERT_MLP),
                  "shared_up": (SHARED_MLP, HIDDEN), "shared_down": (HIDDEN, SHARED_MLP),
                  "latent_in": (LATENT, HIDDEN), "latent_out": (HIDDEN, LATENT)},
    "MambaState": {"conv": (BATCH, None, MAMBA_CONV), "ssm": (BATCH, MAMBA_HEADS, None, None)},
    "KVPages": {"k": (PAGES, None, KV_HEADS, None), "v": (PAGES, None, KV_HEADS, None)},
    "DecodeCarry": {**{f: (BATCH,) for f in _BATCH_VECTORS}, "block_tables": (BATCH, None),
                    "sequences": (BATCH, None), "logits": (BATCH, VOCAB), "stop_ids": (None,)},
    "PrefillInputs": {"sequences": (BATCH, None), "lengths": (BATCH,), "max_new": (BATCH,),
                      "block_tables": (BATCH, None), "stop_ids": (None,)},
    "SamplingState": {"temperature": (BATCH,), "top_k": (BATCH,), "top_p": (BATCH,), "keys": (BATCH, None)},
}

DEFAULT_MESH_AXES: dict[str, Any] = {
    BATCH: "data", PAGES: "data", VOCAB: "tensor", HIDDEN: None,
    MAMBA_IN: "tensor", MAMBA_CONV: "tensor", MAMBA_HEADS: "tensor", MAMBA_INNER: "tensor",
    Q_HEADS: "tensor", KV_HEADS: None, MLP: "tensor",
    EXPERTS: "expert", EXPERT_MLP: "tensor", EXPERT_IN: None, SHARED_MLP: "tensor", LATENT: None,
}


def _type_name(key) -> str:
    return key.__name__ if isinstance(key, type) else str(key)


def _mesh_names(value, logical: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise MeshError(f"rules: logical axis {logical!r} maps to {value!r}; give a mesh axis name, a tuple of "
                        "names or None")
    return names


@dataclasses.dataclass(frozen=True)
class Rules:
    """The two tables (module docstring), frozen and hashable (a static value of compiled programs).
    Build with Rules.of(leaf_axes, mesh_axes) or change DEFAULT_RULES with `with_mesh_axes` /
    `with_leaf_axes`; keys of leaf_axes may be types or type names."""

    leaf_axes: tuple[tuple[str, tuple[tuple[str, tuple], ...]], ...]
    mesh_axes: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def of(cls, leaf_axes: Mapping, mesh_axes: Mapping) -> "Rules":
        leaves = tuple(sorted((_type_name(t), tuple(sorted((f, tuple(a)) for f, a in fields.items())))
                              for t, fields in leaf_axes.items()))
        mesh = tuple(sorted((str(k), _mesh_names(v, k)) for k, v in mesh_axes.items()))
        return cls(leaves, mesh)

    def with_mesh_axes(self, **mesh_axes) -> "Rules":
        """These rules with some logical axes mapped anew, e.g. with_mesh_axes(kv_heads="tensor")."""
        return Rules.of(self._leaf_table, {**dict(self.mesh_axes), **mesh_axes})

    def with_leaf_axes(self, leaf_axes: Mapping) -> "Rules":
        """These rules with the given types' field tables added or replaced (e.g. a user layer type)."""
        return Rules.of({**self._leaf_table, **{_type_name(t): f for t, f in leaf_axes.items()}},
                        dict(self.mesh_axes))

    def __repr__(self) -> str:
        mesh = {k: (v[0] if len(v) == 1 else v) if v else None for k, v in self.mesh_axes}
        return f"Rules(mesh_axes={mesh}, leaf_axes for {[t for t, _ in self.leaf_axes]})"

    @functools.cached_property
    def _leaf_table(self) -> dict[str, dict[str, tuple]]:
        return {t: dict(fields) for t, fields in self.leaf_axes}

    @functools.cached_property
    def _mesh_table(self) -> dict[str, tuple[str, ...]]:
        return dict(self.mesh_axes)

    def axes_of(self, type_name: str, field: str) -> tuple | None:
        """Logical axes of a field (None: not in the table, replicated)."""
        return self._leaf_table.get(type_name, {}).get(field)

    def mesh_axes_of(self, logical: str | None, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes a logical axis splits over on a mesh of `mesh_shape`: those it has, of size > 1."""
        if logical is None:
            return ()
        return tuple(n for n in self._mesh_table.get(logical, ()) if mesh_shape.get(n, 1) > 1)


DEFAULT_RULES = Rules.of(DEFAULT_LEAF_AXES, DEFAULT_MESH_AXES)


def leaf_spec(where: str, shape: tuple[int, ...], axes: tuple, rules: Rules,
              mesh_shape: Mapping[str, int], note: str = "") -> PartitionSpec:
    """The PartitionSpec of one leaf of `shape` whose dims have logical `axes`; MeshError naming the
    tensor, the dim and the mesh axis when an axis size does not divide its dim."""
    if len(axes) != len(shape):
        raise MeshError(f"rules: tensor {where}{note} has {len(shape)} dims {list(shape)}, the rules give "
                        f"{len(axes)} logical axes {axes}")
    parts, used = [], {}
    for dim, (logical, size) in enumerate(zip(axes, shape)):
        names = rules.mesh_axes_of(logical, mesh_shape)
        for n in names:
            if n in used:
                raise MeshError(f"rules: tensor {where}{note}: mesh axis {n!r} splits both dim {used[n]} and "
                                f"dim {dim}; map one of their logical axes elsewhere")
            used[n] = dim
        ways = math.prod(mesh_shape[n] for n in names)
        if size % ways:
            axis = names[0] if len(names) == 1 else names
            raise MeshError(f"tensor {where}{note} {list(shape)}: dim {dim} ({logical!r}, size {size}) does not "
                            f"divide over mesh axis {axis!r} of size {ways}; use another mesh, or map "
                            f"{logical!r} to another mesh axis (or None) in the rules")
        parts.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*parts)


def _weight_leaf_axes(weight, axes: tuple) -> dict[str, tuple]:
    """Logical axes of each stored leaf of a quantised weight whose logical weight has `axes`."""
    lead, out, inp = axes[:-2], axes[-2], axes[-1]
    role = {"out": (out,), "in": (inp,), "*": lead}
    return {field: sum((role[d] for d in dims), ()) for field, dims in type(weight).LEAF_DIMS.items()}


_NOTES = {("NVFP4Weight", "packed"): " (e2m1 codes, two a byte: the in dim holds in/2)",
          ("NVFP4Weight", "scale"): " (block scales, transposed: [..., in/16, out])"}


def tree_specs(tree, rules: Rules, mesh_shape: Mapping[str, int], where: str = "", axes: tuple | None = None):
    """`tree` (params, a carry, or any tree of arrays, abstract values or deferred leaves) with a
    PartitionSpec in place of each array leaf, by the rules; MeshError before any device work. axes:
    the logical axes of `tree` itself when it is one field's value (a weight or an array)."""

    def visit(node, where: str, axes: tuple | None):
        if node is None:
            return None
        if isinstance(node, (tuple, list)):
            return type(node)(visit(v, f"{where}[{i}]", None) for i, v in enumerate(node))
        if is_quantized(node):
            leaf_axes = _weight_leaf_axes(node, axes) if axes is not None else {}
            return dataclasses.replace(node, **{
                f: visit_leaf(getattr(node, f), f"{where}.{f}", leaf_axes.get(f),
                              _NOTES.get((type(node).__name__, f), "")) for f in type(node).LEAF_DIMS})
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            name = type(node).__name__
            return dataclasses.replace(node, **{
                f.name: visit(getattr(node, f.name), f"{where}.{f.name}" if where else f.name,
                              rules.axes_of(name, f.name))
                for f in dataclasses.fields(node) if f.init and not f.metadata.get("static")})
        return visit_leaf(node, where, axes, "")

    def visit_leaf(leaf, where, axes, note):
        if leaf is None:  # an optional leaf (a weight-only format's input_scale)
            return None
        shape = tuple(leaf.shape)
        return leaf_spec(where, shape, (None,) * len(shape) if axes is None else tuple(axes), rules, mesh_shape,
                         note)

    return visit(tree, where, axes)
