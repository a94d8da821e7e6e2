"""Layer-swap experiments on the tiny checkpoint: Mamba -> attention, a user stateful recurrent mixer,
a dropped layer. Each variant generates through the real engine (prefill + decode).

    python examples/layer_swap.py
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import nemoh
from nemoh import surgery
from nemoh.engine.prefill import prefill
from nemoh.layers.attention import AttentionParams

TINY = "checkpoints/tiny-nemotron-h"


def attention_like(layer, cfg, key) -> AttentionParams:
    """A fresh attention layer (random projections) keeping the replaced layer's pre-norm."""
    H, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    k = jax.random.split(key, 4)
    w = lambda k, o, i: (jax.random.normal(k, (o, i)) / np.sqrt(i)).astype(layer.norm.dtype)
    return AttentionParams(norm=layer.norm, q_proj=w(k[0], q, H), k_proj=w(k[1], kv, H), v_proj=w(k[2], kv, H),
                           o_proj=w(k[3], H, q))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecayingAverage:
    """A user recurrent mixer: s_t = a * s_{t-1} + (1 - a) * x_t W_in, out_t = s_t W_out. Its state is
    [b, D]; padding rows (past valid_len) leave it unchanged."""

    norm: jax.Array
    w_in: jax.Array   # [D, H]
    w_out: jax.Array  # [H, D]
    decay: jax.Array  # scalar

    def init_state(self, cfg, shape):
        return jnp.zeros((shape.batch, self.w_in.shape[0]), jnp.float32)

    def mix(self, h, cfg, state, ctx):
        x = (h.astype(jnp.float32) @ self.w_in.T.astype(jnp.float32))  # [b, T, D]
        real = ctx.token_mask()
        start = jnp.zeros((h.shape[0], self.w_in.shape[0]), jnp.float32) if state is None else state

        def step(s, inputs):
            xt, rt = inputs
            s = jnp.where(rt[:, None], self.decay * s + (1 - self.decay) * xt, s)
            return s, s

        final, seq = jax.lax.scan(step, start, (jnp.moveaxis(x, 1, 0), jnp.moveaxis(real, 1, 0)))
        out = jnp.moveaxis(seq, 0, 1) @ self.w_out.T.astype(jnp.float32)
        return out.astype(h.dtype), (None if state is None else final)


def main() -> dict:
    params = nemoh.load(TINY, dtype=jnp.float32)
    cfg = params.config
    prompt = [[5, 17, 3, 99, 42]]
    mamba = surgery.select(params, "mamba")[0]
    as_attention = surgery.replace(params, mamba, lambda i, old: attention_like(old, cfg, jax.random.key(0)))
    carry = prefill(as_attention, prompt, max_new_tokens=4)
    print(f"layer {mamba} is now {type(as_attention.layers[mamba]).__name__}; its carried state is "
          f"{type(carry.states[mamba]).__name__}; config pattern {as_attention.config.pattern}")

    D = 16
    k1, k2 = jax.random.split(jax.random.key(1))
    recurrent = surgery.replace(params, "mlp", lambda i, old: DecayingAverage(
        old.norm, jax.random.normal(k1, (D, cfg.hidden_size)) / 8, jax.random.normal(k2, (cfg.hidden_size, D)) / 4,
        jnp.float32(0.9)))
    shorter = surgery.drop(params, -1)
    out = {name: nemoh.generate(p, prompt, max_new_tokens=6)[0]
           for name, p in (("original", params), ("mamba_to_attention", as_attention),
                           ("recurrent_mixer", recurrent), ("dropped_last", shorter))}
    for name, tokens in out.items():
        print(f"{name:>20}: {tokens}")
    return {"tokens": out, "swapped_layer": mamba, "swapped_state": carry.states[mamba],
            "recurrent_state": prefill(recurrent, prompt, max_new_tokens=4).states[surgery.select(params, "mlp")[0]]}


if __name__ == "__main__":
    main()
