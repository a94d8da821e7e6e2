"""Property-based: generated bad and edge-case arguments to generate, forward and CacheSpec end in a
NemohError or a valid result, never another exception type and never a hang (derandomized, so CI
runs the same examples every time)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import nemoh
from nemoh import CacheSpec, NemohError

SHIPPED = Path(__file__).parents[1] / "checkpoints" / "tiny-nemotron-h"
V = 256
SETTINGS = dict(derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# values of the wrong kind for any argument
junk = st.one_of(
    st.none(), st.booleans(), st.text(max_size=4), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**80), 2**80), st.just(np.bool_(True)), st.just(np.float32("nan")), st.just(object()),
    st.just([]), st.just({"a": 1}), st.just(np.zeros((2, 2))), st.lists(st.integers(-3, 3), min_size=1, max_size=3),
)
token = st.one_of(st.integers(-2, V + 2), st.sampled_from([True, 1.0, "3", None, np.int8(4), np.uint64(V), 2**70]))
valid_prompts = st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=5), min_size=1, max_size=3)
bad_prompts = st.one_of(
    st.lists(st.lists(token, max_size=4), max_size=3),
    st.lists(token, max_size=4),
    st.builds(lambda b, t, dt: np.zeros((b, t), dt), st.integers(0, 2), st.integers(0, 3),
              st.sampled_from([np.int32, np.int64, np.uint8, np.float32, np.bool_])),
    st.builds(lambda s: np.ones(s, np.int32), st.sampled_from([(2, 2, 2), (), (1, 1, 1)])),
    junk,
)


def rows(n: int, value):
    """One value for every prompt, or a list of one per prompt."""
    return st.one_of(value, st.lists(value, min_size=n, max_size=n))


def edge_rows(value):
    return st.one_of(value, st.lists(st.one_of(value, junk, st.lists(junk, max_size=2)), max_size=4), junk)


# Valid values: cheap requests only. Edge values: junk, out of range, or valid but extreme (refused
# before work as too big for memory, or cheap). Never slow.
VALID = {
    "max_new_tokens": lambda n: st.one_of(st.integers(1, 4), st.just(np.int64(2))),
    "temperature": lambda n: rows(n, st.one_of(st.floats(0, 3), st.sampled_from([0.0, 1e-30, 1e30, np.float16(1)]))),
    "top_k": lambda n: rows(n, st.one_of(st.none(), st.integers(1, V + 2), st.integers(2**31, 2**70))),
    "top_p": lambda n: rows(n, st.one_of(st.none(), st.floats(1e-9, 1.0))),
    "seed": lambda n: rows(n, st.integers(-(2**80), 2**80)),
    "stop_token_ids": lambda n: st.one_of(st.none(), st.lists(st.integers(0, V - 1), max_size=3),
                                          st.sets(st.integers(0, V - 1), max_size=3)),
    "ignore_eos": lambda n: st.booleans(),
    # the default compiled pool shape (16 slots x 64 pages of 16)
    "cache": lambda n: st.sampled_from([CacheSpec(), CacheSpec(num_pages=1024)]),
    "prefill_chunk": lambda n: st.just(256),
    "steps_per_call": lambda n: st.sampled_from([32, 1, 3]),
}
EDGE = {
    "max_new_tokens": st.one_of(st.integers(-3, 0), st.integers(10**8, 2**80), junk),
    "temperature": edge_rows(st.one_of(st.floats(-1, 0, exclude_max=True), st.sampled_from([3.5e38, -0.0]), junk)),
    "top_k": edge_rows(st.one_of(st.integers(-3, 0), junk)),
    "top_p": edge_rows(st.one_of(st.floats(-0.5, 0), st.floats(1.0, 1.5, exclude_min=True), junk)),
    "seed": edge_rows(junk),
    "stop_token_ids": st.one_of(st.lists(token, max_size=3), junk),
    "ignore_eos": junk,
    "cache": st.one_of(st.sampled_from([CacheSpec(memory_budget_bytes=10), CacheSpec(memory_budget_bytes=10**18)]),
                       junk),
    "prefill_chunk": st.one_of(st.sampled_from([0, -1, 2**40]), junk),
    "steps_per_call": st.one_of(st.sampled_from([0, -5, 2**31]), junk),
}


@pytest.fixture(scope="module")
def params():
    return nemoh.load(SHIPPED, dtype=jnp.float32)


def _max_new(kwargs) -> int:
    m = kwargs.get("max_new_tokens")
    return int(m) if isinstance(m, (int, np.integer)) and not isinstance(m, bool) else 0


@settings(max_examples=50, **SETTINGS)
@given(data=st.data())
def test_generate_named_error_or_valid_result(params, data):
    """A valid request with up to two arguments (or the prompts) replaced by edge values."""
    broken = data.draw(st.sets(st.sampled_from(["prompt_ids", *EDGE]), max_size=2), label="broken")
    prompts = data.draw(bad_prompts if "prompt_ids" in broken else valid_prompts, label="prompt_ids")
    n = len(prompts) if "prompt_ids" not in broken else 1
    kwargs = {k: data.draw(EDGE[k] if k in broken else VALID[k](n), label=k) for k in EDGE
              if k in broken or k == "max_new_tokens" or data.draw(st.booleans(), label=f"give {k}")}
    try:
        out = nemoh.generate(params, prompts, **kwargs)
    except NemohError as e:
        event(type(e).__name__)
        return
    event("valid result")
    assert isinstance(out, list) and all(isinstance(row, list) for row in out)
    assert all(1 <= len(row) <= _max_new(kwargs) and all(0 <= t < V for t in row) for row in out)


@settings(max_examples=40, **SETTINGS)
@given(tokens=st.one_of(
    st.lists(st.lists(st.integers(0, V - 1), min_size=2, max_size=2), min_size=1, max_size=2),  # valid, 2 shapes
    st.lists(st.lists(token, max_size=3), max_size=3), st.lists(token, max_size=3),
    st.builds(lambda s, dt: np.ones(s, dt), st.sampled_from([(0, 2), (1, 0), (2, 2, 1), (3,), (1, 3)]),
              st.sampled_from([np.int32, np.uint16, np.float64, np.bool_, np.int64])),
    junk,
))
def test_forward_named_error_or_logits(params, tokens):
    try:
        logits = nemoh.forward(params, tokens)
    except NemohError as e:
        event(type(e).__name__)
        return
    event("valid result")
    shape = np.shape(np.asarray(tokens))
    assert logits.shape == ((1,) if len(shape) == 1 else ()) + shape + (V,)
    assert np.isfinite(np.asarray(logits)).all()


@settings(max_examples=300, **SETTINGS)
@given(page_size=st.one_of(st.integers(-3, 2**40), junk), num_pages=st.one_of(st.none(), st.integers(-3, 2**40), junk),
       memory_budget_bytes=st.one_of(st.none(), st.integers(-3, 2**70), junk))
def test_cachespec_named_error_or_valid(page_size, num_pages, memory_budget_bytes):
    try:
        spec = CacheSpec(page_size=page_size, num_pages=num_pages, memory_budget_bytes=memory_budget_bytes)
    except NemohError:
        return
    assert isinstance(spec.page_size, (int, np.integer)) and spec.page_size >= 1
    assert num_pages is None or memory_budget_bytes is None
