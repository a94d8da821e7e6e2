"""flax.nnx Modules as layers (flax is an optional extra: `pip install nemoh[flax]`).

NNXLayer holds a Module split into its graph definition (static) and its state (a pytree of arrays),
and merges them back inside the mixer, so under jit the layer is a pure pytree like any other. The
Module is called as module(h, cfg, state, ctx) -> (out, new state), the layer protocol's mix; if it
has init_state(cfg, shape) the layer carries that state through prefill and decode, else none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NNXLayer:
    """norm [H]: the pre-norm weight; graphdef (static) and state: the split Module."""

    norm: jax.Array
    state: Any
    graphdef: Any = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def wrap(cls, module, norm: jax.Array) -> "NNXLayer":
        from flax import nnx

        graphdef, state = nnx.split(module)
        return cls(norm=norm, state=state, graphdef=graphdef)

    def module(self):
        from flax import nnx

        return nnx.merge(self.graphdef, self.state)

    def mix(self, h, cfg, state, ctx):
        return self.module()(h, cfg, state, ctx)

    def init_state(self, cfg, shape):
        module = self.module()
        return module.init_state(cfg, shape) if hasattr(module, "init_state") else None
