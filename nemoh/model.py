"""The NemotronH model: the params pytree and the layer stack.

Each block is  h = h + layer.mix(rms_norm(h, layer.norm)). Every entry of `params.layers` follows the
layer protocol (nemoh.layers.protocol): it carries its mixer and how to make its carried state, so a
researcher swaps a layer by putting an object of another type into `params.layers` (see
docs/swapping_layers.md and nemoh.surgery). Carried state (Mamba windows/states, KV pages, a user
layer's own) is passed per layer and returned updated; None for a stateless full-sequence forward.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from nemoh import validate
from nemoh.config import NemotronHConfig
from nemoh.layers.context import TokenContext
from nemoh.layers.norms import rms_norm
from nemoh.layers.protocol import check_layer, check_state
from nemoh.sharding.params import resolve
from nemoh.sharding.placement import Placement, tracing
from pallas_kernels import Weight, linear, trace_settings

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

    def __repr__(self) -> str:
        """One screen: pattern, dtype, and per layer kind the count, its matrices by storage format
        (dense dtype, FP8, NVFP4) and its bytes (the full tree: treescope's view, or jax.tree.map)."""
        from pallas_kernels import is_quantized

        kinds: dict[str, list] = {}
        for layer in self.layers:
            entry = kinds.setdefault(layer_scope(layer), [0, {}, 0])
            entry[0] += 1
            for leaf in jax.tree.leaves(layer, is_leaf=is_quantized):
                fmt = type(leaf).__name__.removesuffix("Weight") if is_quantized(leaf) else str(leaf.dtype)
                if is_quantized(leaf) or leaf.ndim >= 2:
                    entry[1][fmt] = entry[1].get(fmt, 0) + 1
                entry[2] += sum(a.nbytes for a in jax.tree.leaves(leaf))
        rows = [f"  {kind}: {n} layer(s), matrices {dict(sorted(f.items()))}, {b / 2**20:.1f} MiB"
                for kind, (n, f, b) in kinds.items()]
        if self.lm_head is None:
            head_fmt = "tied to the embedding"
        else:
            head_fmt = type(self.lm_head).__name__ if is_quantized(self.lm_head) else str(self.lm_head.dtype)
        total = sum(a.nbytes for a in jax.tree.leaves(self))
        return "\n".join([f"ModelParams({self.config.pattern!r}, {len(self.layers)} layers, dtype {self.dtype}, "
                          f"hidden {self.config.hidden_size}, vocab {self.config.vocab_size}, {total / 2**20:.1f} MiB)",
                          *rows, f"  lm_head: {head_fmt}"])

    def committed(self) -> "ModelParams":
        """These params committed to the one device they are on (no copy). load, random_params and an
        orbax restore all return committed params, so jit compiles one program for the three (an
        uncommitted array lowers without a sharding, a committed one with it: two programs, and two
        entries in the persistent compilation cache). Under a trace (jax.eval_shape) there is nothing to
        commit."""
        if isinstance(self.embed, jax.core.Tracer):
            return self
        return jax.device_put(self, next(iter(self.embed.devices())))

    def _repr_html_(self) -> str:
        """Notebooks: treescope's interactive view of the whole tree when treescope is installed."""
        try:
            import treescope
        except ImportError:
            import html

            return f"<pre>{html.escape(repr(self))}</pre>"
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # not self: no recursion
        return treescope.render_to_html(fields, roundtrip_mode=False)


def apply_mixer(layer, h: jax.Array, cfg: NemotronHConfig, state, ctx: TokenContext) -> tuple[jax.Array, Any]:
    """One layer's mixer on its normed input h [b, T, H] -> (out [b, T, H], new state), under the
    layer's named scope."""
    with jax.named_scope(layer_scope(layer)):
        return layer.mix(h, cfg, state, ctx)


def run_layers(params: ModelParams, tokens: jax.Array, ctx: TokenContext, states: tuple | None
               ) -> tuple[jax.Array, tuple | None]:
    """tokens [b, T] -> (final-normed hidden [b, T, H], new per-layer states).

    states: one entry per layer (what its init_state made), or None for a fresh full-sequence forward.
    A layer that does not follow the protocol, or whose mixer changes its state's structure, raises
    LayerError naming it when the program is traced, before any device work.
    """
    cfg = params.config
    h = params.embed[tokens]
    new_states = []
    for i, layer in enumerate(params.layers):
        check_layer(i, layer)
        state = None if states is None else states[i]
        h, new = _block(layer, h, cfg, state, ctx)
        if states is not None:
            check_state(i, layer, state, new)
        new_states.append(new)
    h = rms_norm(h, params.norm_f, cfg.layer_norm_epsilon)
    return h, (None if states is None else tuple(new_states))


def _apply_block(layer, h: jax.Array, cfg: NemotronHConfig, state, ctx: TokenContext, kernels: tuple = ()):
    """h + layer.mix(rms_norm(h)) -> (h [b, T, H], new state): one block. kernels: the kernel package's
    trace settings, only a key of _apply_block_jit's cache."""
    out, new = apply_mixer(layer, rms_norm(h, layer.norm, cfg.layer_norm_epsilon), cfg, state, ctx)
    return h + out.astype(h.dtype), new


_apply_block_jit = jax.jit(_apply_block, static_argnames=("cfg", "kernels"))


def _block(layer, h, cfg, state, ctx):
    """One block, as a nested jit where the layer is a pytree of arrays: layers of one type and shapes
    (Nano's 23 Mamba and 23 MoE layers) are then traced and lowered once, and called from the program
    (XLA inlines the calls: the compiled program is the same). A layer holding anything else is traced
    in place."""
    if all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves((layer, state))):
        return _apply_block_jit(layer, h, cfg, state, ctx, kernels=trace_settings())
    return _apply_block(layer, h, cfg, state, ctx)


def layer_scope(layer) -> str:
    """The named scope a layer's ops carry in compiled programs (profiles group kernels by it):
    the params type's name without "Params", lower case (mamba, attention, moe, mlp, ...)."""
    return type(layer).__name__.removesuffix("Params").lower()


def logits_from_hidden(params: ModelParams, h: jax.Array) -> jax.Array:
    """h [..., H] -> fp32 logits [..., V] (lm_head output in model dtype, then widened, as HF does)."""
    head = params.embed if params.lm_head is None else params.lm_head
    with jax.named_scope("lm_head"):
        return linear(h, head).astype(jnp.float32)


@partial(jax.jit, static_argnames=("placement",))
def _forward(params: ModelParams, tokens: jax.Array, placement: Placement | None) -> jax.Array:
    b, T = tokens.shape
    with tracing(placement):
        h, _ = run_layers(params, tokens, TokenContext.full(b, T, placement), None)
        return logits_from_hidden(params, h)


def forward(params: ModelParams, tokens, *, mesh=None, rules=None) -> jax.Array:
    """Full-sequence forward from position 0: tokens [b, T] (or [T]) int -> logits [b, T, V] fp32.

    Concrete token ids are checked against the vocabulary (RequestError); under an outer jit they
    cannot be, and out-of-range ids would silently clamp, so validate before tracing. mesh, rules: run
    sharded (see nemoh.sharding; params already on a mesh run on it without them).
    """
    validate.instance("params", params, ModelParams, "ModelParams (from nemoh.load)")
    if not isinstance(tokens, jax.core.Tracer):
        tokens = validate.check_token_ids(tokens, params.config.vocab_size)
    params, placement = resolve(params, mesh, rules)
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    return _forward(params, tokens, placement)
