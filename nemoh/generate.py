"""generate(params, prompt_ids, ...): the notebook entry point."""

from __future__ import annotations

from typing import Callable

import numpy as np

from nemoh import validate
from nemoh.engine.decode import decode
from nemoh.engine.kv_pages import CacheSpec
from nemoh.engine.prefill import prefill
from nemoh.engine.sampling import Sampling
from nemoh.model import ModelParams
from nemoh.sharding.placement import to_host


def generate(params: ModelParams, prompt_ids, *, max_new_tokens: int, temperature=0.0, top_k=None, top_p=None,
             seed=0, stop_token_ids=None, ignore_eos: bool = False,
             on_token: Callable[[int, int], None] | None = None,
             cache: CacheSpec = CacheSpec(), prefill_chunk: int | None = None, steps_per_call: int = 32,
             mesh=None, rules=None) -> list[list[int]]:
    """Generate up to max_new_tokens for each prompt; returns the new tokens per prompt, in order.

    temperature, top_k, top_p and seed take one value for every prompt or a list of one per prompt
    (see Sampling); temperature 0 is greedy. A prompt's sampled tokens depend only on the params, the
    prompt, its settings and its seed (any integer, used whole), not on the other prompts. A sequence
    ends after the config's eos token (unless ignore_eos) or one of stop_token_ids; the stop token is
    included. prefill_chunk: prompt tokens per row per prefill chunk (None: the engine's default, about
    2048 across the batch slots on a GPU, 256 on a CPU). steps_per_call decode steps run on the device
    per host call; on_token(prompt_index, token) is called for each new token as they arrive. mesh,
    rules: run sharded over a jax Mesh by the rules (nemoh.sharding; default DEFAULT_RULES), params and
    carry alike; params already placed on a mesh (nemoh.load(..., mesh=...)) run on it without them.
    Every argument is checked before any device work (RequestError, CacheCapacityError, MeshError);
    NaN/Inf logits raise NonFiniteError.
    """
    validate.instance("params", params, ModelParams, "ModelParams (from nemoh.load)")
    cfg = params.config
    prompts = validate.prompt_list(prompt_ids, cfg.vocab_size)
    ignore_eos = validate.boolean("ignore_eos", ignore_eos)
    if on_token is not None and not callable(on_token):
        validate.fail("on_token", on_token, "must be None or a callable on_token(prompt_index, token)")
    steps_per_call = validate.integer("steps_per_call", steps_per_call, 1, validate.INT32_MAX)
    stops = validate.token_id_list("stop_token_ids", stop_token_ids, cfg.vocab_size)
    if not ignore_eos:
        stops = stops + cfg.eos_token_ids
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)

    carry = prefill(params, prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stops, seed=seed,
                    cache=cache, prefill_chunk=prefill_chunk, mesh=mesh, rules=rules)
    n = len(prompts)
    starts = np.array([len(p) for p in prompts])
    streamed = np.zeros(n, np.int64)

    def stream(carry) -> bool:
        counts, finished = to_host(carry.num_generated)[:n], to_host(carry.finished)[:n]
        if on_token is not None and (counts > streamed).any():
            seqs = to_host(carry.sequences)
            for i in range(n):
                for t in seqs[i, starts[i] + streamed[i] : starts[i] + counts[i]]:
                    on_token(i, int(t))
        streamed[:] = counts
        return bool(finished.all())

    done = stream(carry)
    while not done:
        carry = decode(params, carry, steps_per_call)
        done = stream(carry)
    seqs = to_host(carry.sequences)
    return [seqs[i, starts[i] : starts[i] + streamed[i]].tolist() for i in range(n)]
