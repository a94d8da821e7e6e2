"""Per-row sampling: a prompt's tokens depend only on (params, prompt, settings, seed), never on its
batch mates or position; per-row settings and seeds; seeds used whole; varied generate() calls
reuse a few compiled programs (counted through jax.monitoring's compile events); and the sort-free
top-k / top-p cut keeps what a sort keeps."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import nemoh
from compile_events import compiles
from nemoh.engine.prefill import prefill

SHIPPED = Path(__file__).parents[1] / "checkpoints" / "tiny-nemotron-h"
P = [5, 6, 7, 8]
RUN = dict(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    return nemoh.load(SHIPPED, dtype=jnp.float32)


def _sample(params, prompts, **kw):
    return nemoh.generate(params, prompts, **{**RUN, "temperature": 1.0, "seed": 11, **kw})


def test_varied_calls_reuse_compiled_programs(params):
    rng = np.random.default_rng(0)
    prompts = lambda *lengths: [rng.integers(0, 256, n).tolist() for n in lengths]
    calls = [
        (prompts(5), dict(max_new_tokens=4)),
        (prompts(1, 17, 300), dict(max_new_tokens=9, temperature=0.7, seed=1)),
        (prompts(*range(1, 17)), dict(max_new_tokens=2, top_k=5, temperature=1.0)),
        (prompts(2000), dict(max_new_tokens=3, top_p=0.9, temperature=0.8)),
        (prompts(40, 2), dict(max_new_tokens=12, temperature=[0.0, 1.3], top_k=[None, 3])),
        (prompts(700, 1, 3, 9, 150), dict(max_new_tokens=6, top_p=0.5, temperature=2.0, seed=[1, 2, 3, 4, 5])),
        (prompts(64), dict(max_new_tokens=1)),
        (prompts(*[7] * 11), dict(max_new_tokens=5, temperature=0.3, stop_token_ids=[4, 9])),
        (prompts(500, 1), dict(max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.95)),
        (prompts(128, 256, 512), dict(max_new_tokens=7, steps_per_call=3)),
    ]
    jax.clear_caches()
    with compiles() as first:
        nemoh.generate(params, calls[0][0], **calls[0][1])
    with compiles() as later:
        for p, kw in calls[1:]:
            out = nemoh.generate(params, p, **kw)
            assert len(out) == len(p) and all(1 <= len(o) <= kw["max_new_tokens"] for o in out)
    print(f"first call compiled {first}; the next {len(calls) - 1} calls compiled {later}")
    assert {"jit(_prefill)", "jit(_decode)"} <= set(first)
    assert len(later) <= 4, later
    with compiles() as control:  # a new chunk width is a new prefill program: the counter sees it
        nemoh.generate(params, prompts(5), max_new_tokens=4, prefill_chunk=64)
    assert control == ["jit(_prefill)"], control


def test_sampled_row_ignores_batch_mates_and_position(params):
    alone = _sample(params, [P])[0]
    assert len(set(alone)) > 4  # really sampled
    assert _sample(params, [[1] * 30, P, [9, 9]])[1] == alone
    shuffled = _sample(params, [P, [9, 9], [1] * 30, P])
    assert shuffled[0] == shuffled[3] == alone
    # a 1100-token mate moves the batch to 2048-token rows: another compiled program, same tokens
    assert _sample(params, [[3] * 1100, [9, 9], P])[2] == alone
    assert _sample(params, [P], seed=12)[0] != alone


def test_per_prompt_seeds_and_settings(params):
    alone = {s: _sample(params, [P], seed=s)[0] for s in (11, 12)}
    assert _sample(params, [P, P], seed=[11, 12]) == [alone[11], alone[12]]
    greedy = nemoh.generate(params, [P], **RUN)[0]
    top3 = _sample(params, [[9, 9]], top_k=3, top_p=0.9)[0]
    mixed = _sample(params, [P, [9, 9]], temperature=[0.0, 1.0], top_k=[None, 3], top_p=[None, 0.9])
    assert mixed == [greedy, top3]
    assert _sample(params, [P], top_k=1)[0] == greedy


def test_seeds_are_used_whole(params):
    base = _sample(params, [P], seed=7)[0]
    wide = {s: _sample(params, [P], seed=s)[0] for s in (7 + 2**32, 2**70, -7, 2**64 - 1)}
    assert all(v != base for v in wide.values())
    assert len({tuple(v) for v in wide.values()}) == len(wide)
    assert _sample(params, [P], seed=2**70)[0] == wide[2**70]


def test_rows_are_bitwise_batch_independent_in_bf16_and_fp32():
    """Within a slot bucket a row runs the same compiled program whatever its mates and position:
    its logits are bitwise those it has with another mate (the same 16-slot bucket), in bf16 and fp32."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (2, 9, 33, 57)]
    for dtype in (jnp.bfloat16, jnp.float32):
        params = nemoh.load(SHIPPED, dtype=dtype)
        alone = [np.asarray(prefill(params, [p, [5]], max_new_tokens=4).logits[0]) for p in prompts]
        batch = np.asarray(prefill(params, prompts[::-1] + [[7] * 20], max_new_tokens=4).logits)
        assert all((batch[len(prompts) - 1 - i] == alone[i]).all() for i in range(len(prompts))), dtype


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cut_keeps_what_sorting_keeps(data):
    """The sampler's sort-free cut keeps exactly what sorting keeps: top-k (ties at the k-th value
    kept), then the nucleus of the renormalised top-k mass, on values with ties and -inf entries."""
    from benchmarks.sampler import BOUNDARY, kept_by_rule
    from nemoh.engine.sampling import _cut

    v, rows = data.draw(st.sampled_from([1, 2, 7, 40])), data.draw(st.sampled_from([1, 3]))  # 8 programs
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    scale = data.draw(st.sampled_from([0.0, 0.05, 1.0, 4.0, 60.0]))
    x = (rng.standard_normal((rows, v)) * scale).astype(np.float32)
    if data.draw(st.booleans()):
        x = np.round(x)  # ties
    x[:, : data.draw(st.integers(0, v - 1))] = -np.inf  # left out by an earlier mask
    x -= x.max(-1, keepdims=True)
    k = np.asarray([data.draw(st.integers(1, v + 3)) for _ in range(rows)], np.int32)  # beyond V: no limit
    p = np.asarray([data.draw(st.sampled_from([0.01, 0.3, 0.5, 0.9, 0.999, 1.0])) for _ in range(rows)], np.float32)
    cut = np.asarray(jax.jit(_cut)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(p)))
    for row in range(rows):
        kept, margin = kept_by_rule(x[row], int(k[row]), float(p[row]))
        event(f"kept {'all' if kept == v else 'some'}")
        if margin > BOUNDARY:  # else rounding decides on which side of top_p the last entry falls
            assert int(np.sum(x[row] >= cut[row])) == kept, (x[row], k[row], p[row], cut[row])
