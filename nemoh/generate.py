"""generate(params, prompt_ids, ...): the notebook entry point."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from nemoh.engine.decode import decode
from nemoh.engine.kv_pages import CacheSpec
from nemoh.engine.prefill import prefill
from nemoh.engine.sampling import Sampling
from nemoh.errors import RequestError
from nemoh.model import ModelParams
from nemoh.validate import check_token_ids


def as_prompt_list(prompt_ids, vocab_size: int) -> list[np.ndarray]:
    """A list of lists of ints, or a 1-D / 2-D integer array -> list of 1-D int32 arrays (validated)."""
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(isinstance(p, (list, tuple, np.ndarray, jax.Array))
                                                                    for p in prompt_ids):
        rows = list(prompt_ids)
    elif isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(isinstance(t, (int, np.integer)) for t in prompt_ids):
        rows = [prompt_ids]
    elif isinstance(prompt_ids, (np.ndarray, jax.Array)):
        arr = np.asarray(prompt_ids)
        if arr.ndim not in (1, 2):
            raise RequestError(f"prompt_ids array must be 1-D or 2-D, got shape {list(arr.shape)}")
        rows = [arr] if arr.ndim == 1 else list(arr)
    else:
        raise RequestError("prompt_ids must be a non-empty list of lists of ints, or a 1-D/2-D integer array; "
                           f"got {type(prompt_ids).__name__}" + (" (empty)" if not prompt_ids else ""))
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, (list, tuple)) and not all(isinstance(t, (int, np.integer)) for t in row):
            raise RequestError(f"prompt {i} holds non-integer entries: {row!r}"[:200])
        if len(row) == 0:
            raise RequestError(f"prompt {i} is empty")
        out.append(check_token_ids(np.asarray(row), vocab_size, f"prompt {i}").astype(np.int32).reshape(-1))
    return out


def generate(params: ModelParams, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_token_ids=None, ignore_eos: bool = False,
             on_token: Callable[[int, int], None] | None = None,
             cache: CacheSpec = CacheSpec(), prefill_chunk: int = 256, steps_per_call: int = 32
             ) -> list[list[int]]:
    """Generate up to max_new_tokens for each prompt; returns the new tokens per prompt, in order.

    Greedy when temperature == 0. A sequence ends after the config's eos token (unless ignore_eos)
    or one of stop_token_ids; the stop token is included. steps_per_call decode steps run on the
    device per host call; on_token(prompt_index, token) is called for each new token as they arrive.
    """
    cfg = params.config
    prompts = as_prompt_list(prompt_ids, cfg.vocab_size)
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise RequestError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
    if not (isinstance(steps_per_call, int) and steps_per_call >= 1):
        raise RequestError(f"steps_per_call={steps_per_call!r}: must be an integer >= 1")
    stops = tuple(int(t) for t in (stop_token_ids or ()))
    for t in stops:
        if not 0 <= t < cfg.vocab_size:
            raise RequestError(f"stop token id {t} is outside the vocabulary [0, {cfg.vocab_size})")
    if not ignore_eos:
        stops = stops + cfg.eos_token_ids
    sampling = Sampling(temperature=float(temperature), top_k=top_k, top_p=top_p)

    carry = prefill(params, prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stops,
                    seed=seed, cache=cache, prefill_chunk=prefill_chunk)
    streamed = np.zeros(len(prompts), np.int64)

    def stream(carry) -> bool:
        counts, finished = jax.device_get((carry.num_generated, carry.finished))
        if on_token is not None:
            out = np.asarray(jax.device_get(carry.out_tokens))
            for i in range(len(prompts)):
                for t in out[i, streamed[i] : counts[i]]:
                    on_token(i, int(t))
        streamed[:] = counts
        return bool(finished.all())

    done = stream(carry)
    while not done:
        carry = decode(params, carry, steps_per_call, sampling)
        done = stream(carry)
    out = np.asarray(jax.device_get(carry.out_tokens))
    return [out[i, : streamed[i]].tolist() for i in range(len(prompts))]
