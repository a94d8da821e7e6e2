"""Token sampling inside the compiled step: per-row greedy, temperature, top-k and top-p as runtime
values, and a per-row random stream.

A row's draw at generated-token index n uses fold_in(key_row, n), with key_row a hash of the row's
own seed and prompt: its tokens depend only on (params, prompt, settings, seed), never on its batch
mates or its position in the batch. Seeds of any size are hashed whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nemoh import validate

_KEY_DOMAIN = b"nemoh.sampling.v1"


def _temperature(name, v):
    return validate.real(name, v, lo=0.0)


def _top_k(name, v):
    return validate.optional(validate.integer, name, v, 1)


def _top_p(name, v):
    return validate.optional(validate.real, name, v, 0.0, 1.0, True)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling settings: each one value for every prompt or a list of one per prompt.

    temperature >= 0 (0: greedy, exactly the argmax); top_k >= 1 or None (no limit); top_p in (0, 1]
    or None (no limit). top-k applies first, then top-p to what is left; ties at a cut are kept.
    """

    temperature: float | Sequence[float] = 0.0
    top_k: int | None | Sequence[int | None] = None
    top_p: float | None | Sequence[float | None] = None

    def __post_init__(self):
        self.rows(None)

    def rows(self, n: int | None) -> tuple[list[float], list[int | None], list[float | None]]:
        """(temperature, top_k, top_p) for n prompts, each checked (any count when n is None)."""
        return (validate.per_row("temperature", self.temperature, n, _temperature),
                validate.per_row("top_k", self.top_k, n, _top_k),
                validate.per_row("top_p", self.top_p, n, _top_p))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Per-row settings and keys, runtime values of the compiled programs.

    temperature [B] f32 (0: greedy); top_k [B] int32 (vocab size: no limit); top_p [B] f32 (1: no
    limit); keys [B, 2] uint32: raw threefry key data of each row's stream.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array


def row_key(seed: int, prompt: np.ndarray) -> np.ndarray:
    """[2] uint32 key data from the whole seed (any size or sign) and the prompt's token ids."""
    h = hashlib.blake2b(_KEY_DOMAIN, digest_size=8)
    h.update(seed.to_bytes(seed.bit_length() // 8 + 1, "little", signed=True))
    h.update(b"|")
    h.update(np.asarray(prompt, "<i4").tobytes())
    return np.frombuffer(h.digest(), "<u4").copy()


def sampling_state(sampling: Sampling, seeds: list[int], prompts: list[np.ndarray], vocab_size: int,
                   rows: int) -> SamplingState:
    """Host arrays for `rows` slots: the prompts' settings and keys first, then greedy dummy rows."""
    n = len(prompts)
    temperature, top_k, top_p = sampling.rows(n)
    pad = rows - n
    return SamplingState(
        temperature=np.array(temperature + [0.0] * pad, np.float32),
        top_k=np.array([vocab_size if k is None else min(k, vocab_size) for k in top_k] + [vocab_size] * pad,
                       np.int32),
        top_p=np.array([1.0 if p is None else p for p in top_p] + [1.0] * pad, np.float32),
        keys=np.stack([row_key(s, p) for s, p in zip(seeds, prompts)] + [np.zeros(2, np.uint32)] * pad),
    )


def _draw(logits: jax.Array, s: SamplingState, step: jax.Array) -> jax.Array:
    """Temperature, then top-k, then top-p, each per row, with one sort; a categorical draw per row."""
    t = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    x = (logits - jnp.max(logits, axis=-1, keepdims=True)) / t  # <= 0: no overflow at tiny temperatures
    desc = -jnp.sort(-x, axis=-1)
    rank = jnp.arange(x.shape[-1])[None, :]
    in_k = rank < s.top_k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    ahead = jnp.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each token
    nucleus = (ahead < s.top_p[:, None]) | (s.top_p[:, None] >= 1)  # no rounding cut at top_p = 1
    kept = jnp.sum(in_k & nucleus, axis=-1)  # >= 1: the top token always stays
    cut = jnp.take_along_axis(desc, kept[:, None] - 1, axis=-1)
    x = jnp.where(x >= cut, x, -jnp.inf)
    keys = jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k, impl="threefry2x32"), n))(
        s.keys, step)
    return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)


def sample(logits: jax.Array, s: SamplingState, step: jax.Array) -> jax.Array:
    """logits [B, V] fp32, step [B] int32 (tokens each row generated before this one) -> ids [B] int32.

    Rows with temperature 0 take the argmax; the sampler runs only when some row samples.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(s.temperature > 0), lambda: _draw(logits, s, step), lambda: greedy)
    return jnp.where(s.temperature > 0, drawn, greedy)
