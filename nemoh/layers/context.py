"""TokenContext: where the rows of a [b, T] token block sit in their sequences."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenContext:
    """positions [b, T] int32: absolute position of each row's token; valid_len [b] int32: real
    (non-padding) rows, which come first; block_tables [b, P] int32 or None (no KV cache); placement
    (static): the nemoh.sharding Placement of a sharded program, None on one device."""

    positions: jax.Array
    valid_len: jax.Array
    block_tables: jax.Array | None = None
    placement: object = dataclasses.field(default=None, metadata=dict(static=True))

    def token_mask(self) -> jax.Array:
        """[b, T] bool: the real (non-padding) rows."""
        return jnp.arange(self.positions.shape[1])[None, :] < self.valid_len[:, None]

    @staticmethod
    def full(batch: int, length: int, placement=None) -> "TokenContext":
        """A fresh, unpadded block: rows at positions 0..length-1, no cache."""
        pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        return TokenContext(positions=pos, valid_len=jnp.full((batch,), length, jnp.int32), placement=placement)
