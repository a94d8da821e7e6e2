"""The decode step: (params, carry) -> carry, the whole model in one compiled program.

The sampled token is written into the carry on the device and is the next step's input: there is
no host round trip per token. `decode(params, carry, num_steps)` runs up to num_steps steps inside
one jax.lax.while_loop (stopping early once every slot is finished) per host call.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from nemoh.engine.carry import DecodeCarry, check_live, consume
from nemoh.engine.sampling import Sampling, sample
from nemoh.layers.context import TokenContext
from nemoh.model import ModelParams, logits_from_hidden, run_layers


def next_input(carry: DecodeCarry, sampled: jax.Array) -> jax.Array:
    """The token the next step reads: the one just sampled (a seam the stale-input test targets)."""
    return sampled


def step(params: ModelParams, carry: DecodeCarry, sampling: Sampling) -> DecodeCarry:
    """One token for every live slot; finished slots are left untouched (no KV write, no state change)."""
    live = ~carry.finished
    ctx = TokenContext(positions=carry.lengths[:, None], valid_len=live.astype(jnp.int32),
                       block_tables=carry.block_tables)
    h, states = run_layers(params, carry.tokens[:, None], ctx, carry.states)
    logits = logits_from_hidden(params, h[:, 0])
    rng, key = jax.random.split(carry.rng)
    sampled = sample(logits, key, sampling)
    B, max_new = carry.out_tokens.shape
    slot = jnp.minimum(carry.num_generated, max_new - 1)
    out = carry.out_tokens.at[jnp.arange(B), slot].set(jnp.where(live, sampled, carry.out_tokens[jnp.arange(B), slot]))
    num_generated = carry.num_generated + live
    finished = carry.finished | (live & jnp.isin(sampled, carry.stop_ids)) | (num_generated >= max_new)
    return DecodeCarry(
        tokens=jnp.where(live, next_input(carry, sampled), carry.tokens),
        lengths=carry.lengths + live,
        states=states,
        block_tables=carry.block_tables,
        finished=finished,
        rng=rng,
        out_tokens=out,
        num_generated=num_generated,
        logits=jnp.where(live[:, None], logits, carry.logits),
        stop_ids=carry.stop_ids,
    )


@partial(jax.jit, static_argnames=("sampling", "num_steps"), donate_argnums=(1,))
def _decode(params: ModelParams, carry: DecodeCarry, sampling: Sampling, num_steps: int) -> DecodeCarry:
    def cond(state):
        i, c = state
        return (i < num_steps) & ~jnp.all(c.finished)

    def body(state):
        i, c = state
        return i + 1, step(params, c, sampling)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), carry))[1]


def decode(params: ModelParams, carry: DecodeCarry, num_steps: int = 1, sampling: Sampling = Sampling()
           ) -> DecodeCarry:
    """Run up to num_steps decode steps on the device; returns the new carry and consumes the old one
    (passing it again raises StaleCarryError)."""
    check_live(carry)
    new = _decode(params, carry, sampling, num_steps)
    consume(carry)
    return new
