"""DecodeCarry: everything that crosses a decode step, as one explicit pytree.

It is consumed and returned by every step (donated under jit), so no stale copy of any of it can be
read: the next input token is produced on the device inside the step and read there by the next one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nemoh.errors import StaleCarryError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCarry:
    """B sequence slots.

    tokens [B] int32: the last sampled token, the next step's input. lengths [B] int32: tokens already
    in the cache (= position of `tokens`). states: one entry per layer: MambaState (conv window, fp32
    SSM state), KVPages (the layer's page pool) or None. block_tables [B, P] int32: each slot's pages.
    finished [B] bool. rng: PRNG key. out_tokens [B, max_new] int32 with num_generated [B] filled.
    logits [B, V] fp32: the distribution `tokens` was sampled from. stop_ids [S] int32 (may be empty).
    """

    tokens: jax.Array
    lengths: jax.Array
    states: tuple
    block_tables: jax.Array
    finished: jax.Array
    rng: jax.Array
    out_tokens: jax.Array
    num_generated: jax.Array
    logits: jax.Array
    stop_ids: jax.Array


def check_live(carry: DecodeCarry) -> None:
    """Raise StaleCarryError when any buffer of `carry` was already consumed by a step."""
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(carry) if isinstance(leaf, jax.Array)):
        raise StaleCarryError(
            "this DecodeCarry was already consumed by a decode step (its buffers were donated); "
            "use the carry that step returned"
        )


def consume(carry: DecodeCarry) -> None:
    """Delete what donation left behind (backends that do not donate), so reuse fails on every backend."""
    for leaf in jax.tree.leaves(carry):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
