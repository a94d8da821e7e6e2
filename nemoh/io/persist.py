"""nemoh.save and restore: params of any layout written with orbax-checkpoint and read back onto devices.

A saved directory holds `nemoh_params.json` (the config and the tree's structure: each node's type as
an import path, each leaf's shape and dtype) and `arrays/` (orbax's checkpoint of the leaves, keyed by
tree path). Dense, FP8 and NVFP4 weights (in the kernels' layout) and layers of user types are saved
alike; a layer type must be an importable dataclass pytree (registered with
jax.tree_util.register_dataclass), or saving names the layer and refuses. Restoring builds the tree
from the JSON and has orbax write each leaf straight into device memory, with a given sharding.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from nemoh.config import NemotronHConfig
from nemoh.errors import CheckpointError
from nemoh.io.json_file import read_json
from nemoh.model import ModelParams

MANIFEST = "nemoh_params.json"
ARRAYS = "arrays"
FORMAT = "nemoh-orbax/1"

Sharding = jax.sharding.Sharding | Callable[[str, jax.ShapeDtypeStruct], jax.sharding.Sharding] | None


def is_saved_params(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _type_path(t: type) -> str:
    return f"{t.__module__}:{t.__qualname__}"


def _import_type(path: str) -> type:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _describe(node, path: str, leaves: dict[str, jax.Array]):
    """JSON structure of a params subtree; its array leaves go into `leaves` under their tree path."""
    if node is None:
        return None
    if isinstance(node, (jax.Array, np.ndarray)):
        leaves[path] = node
        return {"leaf": path, "shape": list(node.shape), "dtype": str(node.dtype)}
    if isinstance(node, tuple):
        return {"tuple": [_describe(v, f"{path}/{i}", leaves) for i, v in enumerate(node)]}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        cls = type(node)
        if "<locals>" in cls.__qualname__:
            raise CheckpointError(f"{path}: type {cls.__qualname__} is defined inside a function; a saved layer "
                                  "type must be importable (define it at module level)")
        fields = {}
        for f in dataclasses.fields(node):
            if f.metadata.get("static"):
                raise CheckpointError(f"{path}: {cls.__qualname__}.{f.name} is a static field; only the model "
                                      "config may be static in saved params")
            fields[f.name] = _describe(getattr(node, f.name), f"{path}/{f.name}", leaves)
        return {"node": _type_path(cls), "fields": fields}
    raise CheckpointError(f"{path}: cannot save a {type(node).__name__} (params hold arrays, tuples and "
                          "dataclass pytrees)")


def _build(desc, restored: dict[str, jax.Array]):
    if desc is None:
        return None
    if "leaf" in desc:
        return restored[desc["leaf"]]
    if "tuple" in desc:
        return tuple(_build(d, restored) for d in desc["tuple"])
    cls = _import_type(desc["node"])
    return cls(**{name: _build(d, restored) for name, d in desc["fields"].items()})


def _abstract_leaves(desc, out: dict[str, jax.ShapeDtypeStruct], sharding: Sharding) -> None:
    if desc is None:
        return
    if "leaf" in desc:
        sds = jax.ShapeDtypeStruct(tuple(desc["shape"]), np.dtype(desc["dtype"]))
        if callable(sharding):
            s = sharding(desc["leaf"], sds)
        else:
            s = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        out[desc["leaf"]] = jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=s)
        return
    for child in desc["tuple"] if "tuple" in desc else desc["fields"].values():
        _abstract_leaves(child, out, sharding)


def save(params: ModelParams, directory: str | Path) -> Path:
    """Write `params` to the new directory `directory` (orbax-checkpoint); returns it."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    if directory.exists() and any(directory.iterdir()):
        raise CheckpointError(f"output directory {directory} is not empty")
    directory.mkdir(parents=True, exist_ok=True)
    leaves: dict[str, jax.Array] = {}
    layers = []
    for i, layer in enumerate(params.layers):
        try:
            layers.append(_describe(layer, f"layers/{i}", leaves))
        except CheckpointError as e:
            raise CheckpointError(f"layer {i} ({type(layer).__name__}): {e}") from None
    tree = {"embed": _describe(params.embed, "embed", leaves), "norm_f": _describe(params.norm_f, "norm_f", leaves),
            "lm_head": _describe(params.lm_head, "lm_head", leaves), "layers": layers}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / ARRAYS, leaves)
    checkpointer.wait_until_finished()
    manifest = {"format": FORMAT, "config": params.config.to_hf_dict(), "tree": tree}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return directory


def _params(tree: dict, leaves: dict, config, where: Path) -> ModelParams:
    """The saved tree rebuilt with `leaves` (leaf path -> value) in place of its arrays."""
    try:
        layers = tuple(_build(d, leaves) for d in tree["layers"])
    except (ImportError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{where}: cannot rebuild a layer type ({e})") from None
    return ModelParams(config=config, embed=_build(tree["embed"], leaves), norm_f=_build(tree["norm_f"], leaves),
                       lm_head=_build(tree["lm_head"], leaves), layers=layers)


def _leaf_path(key_path) -> str:
    """A jax key path (fields and tuple indices) as the saved tree names the leaf: "layers/3/in_proj/data"."""
    return "/".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in key_path)


def restore(directory: str | Path, *, sharding: Sharding = None, placement=None) -> ModelParams:
    """Read params written by `save`, every leaf placed on the device (or on `sharding`: one Sharding for
    every leaf, or a function (leaf path, ShapeDtypeStruct) -> Sharding; or laid out by a
    nemoh.sharding Placement, checked (MeshError) before anything is read)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    manifest = read_json(directory / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{directory / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    tree = manifest["tree"]
    parts = (tree["embed"], tree["norm_f"], tree["lm_head"], *tree["layers"])
    if placement is not None:
        shapes: dict[str, jax.ShapeDtypeStruct] = {}
        for part in parts:
            _abstract_leaves(part, shapes, None)
        laid_out = placement.shardings(_params(tree, shapes, None, directory / MANIFEST))
        by_path = {_leaf_path(k): s for k, s in jax.tree_util.tree_flatten_with_path(laid_out)[0]}
        sharding = lambda path, sds: by_path[path]
    abstract: dict[str, jax.ShapeDtypeStruct] = {}
    for part in parts:
        _abstract_leaves(part, abstract, sharding)
    try:
        restored = ocp.StandardCheckpointer().restore(directory / ARRAYS, abstract)
    except Exception as e:  # orbax raises several types for a damaged or partial checkpoint
        raise CheckpointError(f"{directory / ARRAYS}: cannot restore ({type(e).__name__}: {e})") from None
    return _params(tree, restored, NemotronHConfig.from_dict(manifest["config"]), directory / MANIFEST)
