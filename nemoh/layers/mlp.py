"""Dense relu^2 MLP: down(relu(up x)^2). Also the shape of every MoE expert and the shared expert."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from nemoh.config import MLP
from nemoh.layers.protocol import Stateless
from nemoh.sharding.local import fit_rows, per_device, psum32, rows_spec
from nemoh.sharding.placement import Placement
from nemoh.sharding.rules import BATCH
from nemoh.sharding.rules import MLP as MLP_WIDTH
from pallas_kernels import Weight, linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLPParams(Stateless):
    """norm [H]; up_proj [F, H]; down_proj [H, F]."""

    norm: jax.Array
    up_proj: Weight
    down_proj: Weight

    HF_KIND: ClassVar[str] = MLP

    def mix(self, h, cfg, state, ctx):
        return mlp_mixer(self, h, ctx.placement), state


def relu2(h: jax.Array) -> jax.Array:
    """relu(h)^2 computed in fp32, returned in h.dtype."""
    r = jax.nn.relu(h.astype(jnp.float32))
    return (r * r).astype(h.dtype)


def relu2_mlp(up: Weight, down: Weight, x: jax.Array) -> jax.Array:
    """x [..., H] -> [..., H]."""
    return linear(relu2(linear(x, up)), down)


def mlp_mixer(p: MLPParams, h: jax.Array, placement: Placement | None = None) -> jax.Array:
    """h [b, T, H] -> [b, T, H]. placement: over a mesh, the width splits over the mesh axes of "mlp"
    (up_proj by rows, down_proj by columns) and one psum adds the parts."""
    if placement is None:
        return relu2_mlp(p.up_proj, p.down_proj, h)
    placement = fit_rows(placement, h.shape[0])
    axes, rows = placement.axes(MLP_WIDTH), placement.axes(BATCH)
    local = lambda p, h: psum32(relu2_mlp(p.up_proj, p.down_proj, h), axes)
    return per_device(placement, local, (placement.specs(p), rows_spec(rows, 3)), rows_spec(rows, 3))(p, h)
