"""The routed experts a decode step actually reads, recorded on the device for the batch legs.

A batch-b step reads the experts its b * k (token, expert) pairs select. Real text spreads b = 32 tokens
over most of the 128 experts; a random-weight model may not: its rows can drift to alike hidden states
and pick the same few experts, and then a batch step reads a fraction of the expert bytes a served
batch would, and its time says little about serving. decode.py runs a few probed steps after its
timed calls and prints the distinct experts per MoE layer and step beside what uniform routing gives.

Probed steps run every MoE layer as RoutingProbe, which computes the layer's routing once more (the
same `route` on the same input) and hands the count of distinct experts among the live rows' pairs
to the host (jax.debug.callback); the layer's output is unchanged. The probed program is a separate
compile, and its callbacks split the step's CUDA graphs: it is never timed.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import jax
import numpy as np

from nemoh import surgery
from nemoh.engine.decode import decode
from nemoh.layers.moe import MoEParams, route

_COUNTS: list[tuple[int, int, int]] = []  # (layer index, distinct experts, live tokens), one per probed layer call


def _record(index: int, expert_ids, live) -> None:
    ids, live = np.asarray(expert_ids), np.asarray(live, bool)
    _COUNTS.append((index, len(np.unique(ids[live])), int(live.sum())))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutingProbe(MoEParams):
    """A MoE layer (index: its place in the model) that also reports how many distinct experts its live
    tokens select."""

    index: int = dataclasses.field(default=0, metadata=dict(static=True))

    def mix(self, h, cfg, state, ctx):
        ids, _ = route(h.reshape(-1, h.shape[-1]), self.router, self.router_bias, cfg)
        jax.debug.callback(functools.partial(_record, self.index), ids, ctx.token_mask().reshape(-1))
        return super().mix(h, cfg, state, ctx)


def probed(params):
    """params with every MoE layer a RoutingProbe (same arrays)."""
    wrap = lambda i, old: RoutingProbe(**{f.name: getattr(old, f.name) for f in dataclasses.fields(MoEParams)},
                                       index=i)
    return surgery.replace(params, MoEParams, wrap)


def routed_experts(params, carry, steps: int):
    """Run `steps` decode steps of `carry` with the MoE layers probed. Returns ({"mean", "min", "max":
    distinct experts per MoE layer and step over live tokens, "tokens": live tokens per step, "layer_steps":
    probed layer calls}, the carry after)."""
    del _COUNTS[:]
    carry = decode(probed(params), carry, steps)
    jax.effects_barrier()
    counts = [distinct for _, distinct, live in _COUNTS if live]
    if not counts:
        raise RuntimeError("routing probe: no MoE layer call with live tokens was recorded")
    stats = {"mean": statistics.fmean(counts), "min": min(counts), "max": max(counts),
             "tokens": max(live for _, _, live in _COUNTS), "layer_steps": len(counts)}
    return stats, carry
