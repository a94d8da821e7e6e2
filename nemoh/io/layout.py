"""The Hugging Face checkpoint layout of a config: every tensor's name and shape, read off the loader.

`build_params` asks its reader for each tensor by name; a reader that only records the requests yields
the layout, so no second key table exists: loading, random params, checkpoint writers and tests all
follow the one in nemoh.io.loader.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nemoh.config import NemotronHConfig


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """name: a tensor's full name, or for a projection its module name (stored as `name + ".weight"` when
    dense, or as ModelOpt's quantised tensors); shape: the tensor's shape ([out, in] for a projection);
    projection: whether it is a linear module (so may be quantised); dtype: the dtype the loader keeps
    it in (None: the model dtype; float32 for router and SSM parameters)."""

    name: str
    shape: tuple[int, ...]
    projection: bool
    dtype: object = None


class _Recorder:
    """A loader reader that hands out nothing and writes down what was asked for."""

    def __init__(self):
        self.specs: list[TensorSpec] = []

    def has(self, name: str) -> bool:
        return False

    def kv_scales(self, module_prefix: str) -> None:
        return None

    def vector(self, name: str, shape: tuple[int, ...], dtype=None) -> np.ndarray:
        self.specs.append(TensorSpec(name, tuple(shape), False, dtype))
        return np.broadcast_to(np.zeros((), np.int8), shape)  # a placeholder the builders may reshape

    def linear(self, module: str, out_dim: int, in_dim: int) -> None:
        self.specs.append(TensorSpec(module, (out_dim, in_dim), True))

    def stacked_linear(self, modules: list[str], out_dim: int, in_dim: int) -> None:
        for m in modules:
            self.linear(m, out_dim, in_dim)


def hf_layout(cfg: NemotronHConfig) -> list[TensorSpec]:
    """Every tensor of an HF-layout NemotronH checkpoint of `cfg`, in loading order."""
    from nemoh.io.loader import build_params

    recorder = _Recorder()
    build_params(cfg, recorder)
    return recorder.specs
