"""The NemotronH model: params pytree, the block registry, and the layer stack.

Each block is  h = h + mixer(rms_norm(h)). The mixer is looked up by the TYPE of the layer's params
(`register_mixer`), so a researcher swaps a layer by putting params of a new registered type into
`params.layers[i]` (see docs/swapping_layers.md). Carried state (Mamba windows/states, KV pages) is
passed per layer and returned updated; None for a stateless full-sequence forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from nemoh import validate
from nemoh.config import NemotronHConfig
from nemoh.layers.attention import AttentionParams, attention_mixer
from nemoh.layers.context import TokenContext
from nemoh.layers.mamba2 import MambaParams, mamba2_mixer
from nemoh.layers.mlp import MLPParams, mlp_mixer
from nemoh.layers.moe import MoEParams, moe_mixer
from nemoh.layers.norms import rms_norm
from nemoh.quant import Weight, linear

# mixer(params, normed h [b, T, H], config, layer state or None, ctx) -> (out [b, T, H], new state)
Mixer = Callable[[Any, jax.Array, NemotronHConfig, Any, TokenContext], tuple[jax.Array, Any]]
_MIXERS: dict[type, Mixer] = {}


def register_mixer(params_type: type, mixer: Mixer) -> None:
    """Make layers whose params are `params_type` run `mixer`. The type needs a `norm` field."""
    _MIXERS[params_type] = mixer


register_mixer(MambaParams, lambda p, h, cfg, state, ctx: mamba2_mixer(p, h, cfg, state, ctx.valid_len))
register_mixer(AttentionParams, attention_mixer)
register_mixer(MLPParams, lambda p, h, cfg, state, ctx: (mlp_mixer(p, h), state))
register_mixer(MoEParams, lambda p, h, cfg, state, ctx: (moe_mixer(p, h, cfg), state))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelParams:
    """config (static); embed [V, H]; norm_f [H]; lm_head [V, H] (None when tied); layers: one params
    object per layer, in order."""

    config: NemotronHConfig = dataclasses.field(metadata=dict(static=True))
    embed: jax.Array
    norm_f: jax.Array
    lm_head: Weight | None
    layers: tuple

    @property
    def dtype(self):
        return self.embed.dtype


def run_layers(params: ModelParams, tokens: jax.Array, ctx: TokenContext, states: tuple | None
               ) -> tuple[jax.Array, tuple | None]:
    """tokens [b, T] -> (final-normed hidden [b, T, H], new per-layer states).

    states: one entry per layer (None for stateless layers), or None for a fresh full-sequence forward.
    """
    cfg = params.config
    h = params.embed[tokens]
    new_states = []
    for i, layer in enumerate(params.layers):
        mixer = _MIXERS.get(type(layer))
        if mixer is None:
            raise TypeError(f"layer {i}: no mixer registered for params type {type(layer).__name__}")
        out, state = mixer(layer, rms_norm(h, layer.norm, cfg.layer_norm_epsilon), cfg,
                           None if states is None else states[i], ctx)
        h = h + out.astype(h.dtype)
        new_states.append(state)
    h = rms_norm(h, params.norm_f, cfg.layer_norm_epsilon)
    return h, (None if states is None else tuple(new_states))


def logits_from_hidden(params: ModelParams, h: jax.Array) -> jax.Array:
    """h [..., H] -> fp32 logits [..., V] (lm_head output in model dtype, then widened, as HF does)."""
    head = params.embed if params.lm_head is None else params.lm_head
    return linear(h, head).astype(jnp.float32)


@jax.jit
def _forward(params: ModelParams, tokens: jax.Array) -> jax.Array:
    b, T = tokens.shape
    h, _ = run_layers(params, tokens, TokenContext.full(b, T), None)
    return logits_from_hidden(params, h)


def forward(params: ModelParams, tokens) -> jax.Array:
    """Full-sequence forward from position 0: tokens [b, T] (or [T]) int -> logits [b, T, V] fp32.

    Concrete token ids are checked against the vocabulary (RequestError); under an outer jit they
    cannot be, and out-of-range ids would silently clamp, so validate before tracing.
    """
    validate.instance("params", params, ModelParams, "ModelParams (from nemoh.load)")
    if not isinstance(tokens, jax.core.Tracer):
        tokens = validate.check_token_ids(tokens, params.config.vocab_size)
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    return _forward(params, tokens)
