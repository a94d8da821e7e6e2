"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nemoh.errors import RequestError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static sampling options (part of the compiled step). temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise RequestError(f"temperature={self.temperature!r}: must be a number >= 0")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise RequestError(f"top_k={self.top_k!r}: must be an integer >= 1 or None")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p={self.top_p!r}: must be in (0, 1] or None")


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """logits [B, V] fp32 -> token ids [B] int32."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / s.temperature
    neg = jnp.finfo(jnp.float32).min
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(scaled, s.top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, neg, scaled)
    if s.top_p is not None and s.top_p < 1:
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each token
        keep_sorted = before < s.top_p  # always keeps the top token
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        scaled = jnp.where(keep, scaled, neg)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
