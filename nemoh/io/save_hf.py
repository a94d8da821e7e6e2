"""save_hf: params -> a Hugging Face-layout checkpoint directory that transformers and nemoh.load read.

Dense params give a dense checkpoint; FP8 / NVFP4 projections are written as ModelOpt tensors (exactly
the bytes they were loaded from: `to_hf` undoes the kernels' layout) with hf_quant_config.json and the
config's quantization_config describing which modules are quantised. Tensor names come from the
loader itself: the loader is run with a reader that hands out name tags instead of tensors, and the
tag tree is matched leaf by leaf with the params.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from nemoh.errors import CheckpointError
from nemoh.io.layout import hf_layout
from nemoh.io.loader import build_params
from nemoh.io.modelopt import CONFIG, HF_QUANT_CONFIG, WEIGHT_FORMATS
from nemoh.io.quantize import DEFAULT_SHARD_BYTES, ShardWriter, new_output_dir, quant_configs, stored_algos
from nemoh.model import ModelParams
from pallas_kernels import is_quantized

_FORMAT_NAMES = {fmt: algo for algo, fmt in WEIGHT_FORMATS.items()}


@dataclasses.dataclass(frozen=True)
class _Tag:
    """Stands where the loader would put a tensor: names (one, or one per stacked expert)."""

    names: tuple[str, ...]

    def reshape(self, *shape) -> "_Tag":  # the loader reshapes conv weights; the layout knows the HF shape
        return self


class _Tagger:
    def has(self, name: str) -> bool:
        return False

    def kv_scales(self, module_prefix: str) -> None:
        return None

    def vector(self, name: str, shape, dtype=None) -> _Tag:
        return _Tag((name,))

    def linear(self, module: str, out_dim: int, in_dim: int) -> _Tag:
        return _Tag((module,))

    def stacked_linear(self, modules: list[str], out_dim: int, in_dim: int) -> _Tag:
        return _Tag(tuple(modules))


def _named_tensors(params: ModelParams):
    """(name, value) for every tensor of the layout: arrays, or FP8Weight / NVFP4Weight per module."""
    cfg = params.config
    tags = build_params(cfg, _Tagger(), tied=params.lm_head is None)
    pairs: list[tuple[_Tag, object]] = []
    jax.tree.map(lambda tag, value: pairs.append((tag, value)), tags, params,
                 is_leaf=lambda x: isinstance(x, _Tag))
    for tag, value in pairs:
        if len(tag.names) == 1:
            yield tag.names[0], value
        else:  # stacked experts: one module per index of the leading axis
            for j, name in enumerate(tag.names):
                yield name, jax.tree.map(lambda a, j=j: a[j], value)


def save_hf(params: ModelParams, directory: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `params` as an HF-layout checkpoint into the new directory `directory`; returns it."""
    directory = Path(directory)
    for i, (layer, kind) in enumerate(zip(params.layers, params.config.layer_kinds, strict=True)):
        if getattr(type(layer), "HF_KIND", None) != kind:
            raise CheckpointError(f"layer {i} ({type(layer).__name__}): the Hugging Face layout has no place for "
                                  f"it (the config says {kind}); save it with nemoh.save instead")
    specs = {s.name: s for s in hf_layout(params.config)}
    new_output_dir(directory)
    writer = ShardWriter(directory, max_shard_bytes)
    plan: dict[str, str | None] = {}
    calibrated = True  # every quantised projection carries its activation scale
    for name, value in _named_tensors(params):
        spec = specs[name]
        if not spec.projection:
            writer.add(name, np.asarray(value).reshape(spec.shape))
        elif is_quantized(value):
            plan[name] = _FORMAT_NAMES[type(value)]
            calibrated = calibrated and value.input_scale is not None
            for suffix, tensor in value.to_hf().items():
                writer.add(f"{name}.{suffix}", np.asarray(tensor))
        else:
            plan[name] = None
            writer.add(name + ".weight", np.asarray(value))
    writer.finish()
    config = params.config.to_hf_dict()
    config["dtype"] = str(params.dtype)
    if any(plan.values()):
        hf_quant, config["quantization_config"] = quant_configs(params.config, stored_algos(plan, calibrated))
        (directory / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return directory
