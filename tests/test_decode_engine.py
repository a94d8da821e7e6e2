"""The token gate (STRICT in fp32 on every tiny checkpoint), the stale-input
red-before proof, prefill+decode logits vs forward, the carry, capacity, bad requests, sampling."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nemoh
import nemoh.engine.decode as decode_mod
import pallas_kernels
from compile_events import LOWER_EVENT, compiles
from nemoh import oracle
from nemoh.engine.decode import decode
from nemoh.engine.kv_pages import CacheSpec
from nemoh.engine.prefill import prefill, prefill_program
from nemoh.engine.sampling import Sampling, SamplingState, sample
from nemoh.gate import compare, default_prompts
from nemoh.layers.context import TokenContext
from nemoh.layers.mamba2 import MambaState
from nemoh.model import run_layers

NEW = 24


def _prompts(cfg):
    return default_prompts(cfg, [2 * cfg.chunk_size + 5, 2, 11], seed=7)  # > chunk, < conv_kernel, middle


@pytest.fixture(scope="module")
def gate_refs(tiny_checkpoints):
    """name -> (params fp32, prompts, oracle greedy tokens): one oracle call for all checkpoints."""
    params = {n: nemoh.load(p, dtype=jnp.float32) for n, p in tiny_checkpoints.items()}
    prompts = {n: _prompts(p.config) for n, p in params.items()}
    jobs = [dict(model_dir=str(tiny_checkpoints[n]), prompts=prompts[n], max_new_tokens=NEW,
                 stop_token_ids=list(params[n].config.eos_token_ids), dtype="float32") for n in params]
    refs = oracle.greedy(jobs)
    return {n: (params[n], prompts[n], [r["tokens"] for r in rows]) for n, rows in zip(params, refs)}


@pytest.mark.parametrize("name", ["all_kinds", "grouped_routing", "latent_moe", "dense"])
def test_gate_strict_and_ragged_equals_alone(gate_refs, name):
    params, prompts, ref = gate_refs[name]
    batch = nemoh.generate(params, prompts, max_new_tokens=NEW)
    result = compare(batch, ref)
    print(f"[{name}] {result.line()}")
    assert result.strict, result.line()
    assert result.total >= NEW * len(prompts) // 2, f"the oracle stopped early: {result.line()}"
    assert [nemoh.generate(params, [p], max_new_tokens=NEW)[0] for p in prompts] == batch


def _run_with(monkeypatch, attr, fake, params, prompts):
    jax.clear_caches()
    monkeypatch.setattr(decode_mod, attr, fake)
    try:
        return nemoh.generate(params, prompts, max_new_tokens=NEW)
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_stale_input_token_is_caught(gate_refs, monkeypatch):
    params, prompts, ref = gate_refs["all_kinds"]
    stale = _run_with(monkeypatch, "next_input", lambda carry, sampled: carry.tokens, params, prompts)
    bad = compare(stale, ref)
    print(bad.line())
    assert not bad.strict and bad.line().endswith("DIVERGENCE")
    assert compare(nemoh.generate(params, prompts, max_new_tokens=NEW), ref).strict


def test_stale_mamba_state_is_caught(gate_refs, monkeypatch):
    params, prompts, ref = gate_refs["all_kinds"]
    real_run_layers = decode_mod.run_layers

    def keep_old_mamba(params_, tokens, ctx, states):
        h, new = real_run_layers(params_, tokens, ctx, states)
        return h, tuple(old if isinstance(old, MambaState) else s for old, s in zip(states, new))

    bad = compare(_run_with(monkeypatch, "run_layers", keep_old_mamba, params, prompts), ref)
    print(bad.line())
    assert not bad.strict


def test_gate_cli(tiny_checkpoints):
    root = Path(__file__).parents[1]
    out = subprocess.run([sys.executable, "-m", "nemoh.gate", "--model", str(tiny_checkpoints["dense"])],
                         cwd=root, capture_output=True, text=True, timeout=600)
    print(out.stdout)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "over 3 prompt(s) (full rows=3, short rows=0, mode=decode) STRICT PASS" in out.stdout


# ---- engine pieces (no oracle) --------------------------------------------------------------------
@pytest.fixture(scope="module")
def params(tiny_checkpoints):
    return nemoh.load(tiny_checkpoints["all_kinds"], dtype=jnp.float32)


def test_prefill_decode_logits_equal_forward(params):
    prompts = [np.arange(3, 45, dtype=np.int32) % 250, np.array([9, 4, 7], np.int32)]
    carry = prefill(params, prompts, max_new_tokens=6, sampling=Sampling(), stop_ids=(), seed=0,
                    cache=CacheSpec(page_size=4), prefill_chunk=16)  # 42 tokens: 3 chunks of 16
    seqs, steps = [list(p) for p in prompts], []
    for step_i in range(6):
        steps.append(np.asarray(carry.logits))
        for b, seq in enumerate(seqs):
            seq.append(int(np.asarray(carry.tokens)[b]))
        if step_i < 5:
            carry = decode(params, carry, 1)
    for b, seq in enumerate(seqs):  # the model is causal: forward's logits at t are those after seq[:t + 1]
        ref = np.asarray(nemoh.forward(params, np.array(seq[:-1]))[0])
        for step_i, logits in enumerate(steps):
            want = ref[len(prompts[b]) - 1 + step_i]
            assert np.max(np.abs(logits[b] - want)) / np.max(np.abs(want)) < 1e-4, (step_i, b)


def test_decode_program_compiles_beside_prefill(params):
    """A new carry shape's decode program is lowered (and compiled) once, on the worker thread, while
    prefill runs; the decode calls reuse it. A one-token request compiles no decode program."""
    with compiles(LOWER_EVENT) as lowered:  # pool sizes no other test uses: programs new to this process
        out = nemoh.generate(params, [[1, 2, 3]], max_new_tokens=5, ignore_eos=True, cache=CacheSpec(num_pages=13),
                             steps_per_call=2)
        nemoh.generate(params, [[1, 2, 3]], max_new_tokens=1, cache=CacheSpec(num_pages=11))
    assert len(out[0]) == 5
    decode_threads = [t for n, t in zip(lowered, lowered.threads) if n == "jit(_decode)"]
    assert len(decode_threads) == 1 and decode_threads[0].startswith("nemoh-decode-compile"), decode_threads


def test_layers_of_one_type_traced_once(params, monkeypatch):
    """Each layer block is a nested jit, so the forward traces a layer type's mixer once per shape, not
    once per layer (the Python part of compiling Nano's 52 layers); the logits are the same."""
    tokens = np.array([[3, 1, 4, 1, 5]], np.int32)
    want = np.asarray(nemoh.forward(params, tokens))
    traced = collections.Counter()
    for kind in {type(layer) for layer in params.layers}:
        def counted(self, *args, real=kind.mix):
            traced[type(self).__name__] += 1
            return real(self, *args)
        monkeypatch.setattr(kind, "mix", counted)
    jax.clear_caches()
    got = np.asarray(nemoh.forward(params, tokens))
    kinds = collections.Counter(type(layer).__name__ for layer in params.layers)
    assert max(kinds.values()) > 1 and traced == {kind: 1 for kind in kinds}, (kinds, traced)
    assert np.array_equal(got, want)
    # a new program traced under other kernel settings traces the blocks again, not reusing those above
    with pallas_kernels.default_impl("xla"):
        jax.jit(lambda p, t: run_layers(p, t, TokenContext.full(*t.shape), None)[0])(params, tokens)
    assert traced == {kind: 2 for kind in kinds}, traced


def test_prefill_inputs_are_sent_by_the_call(params):
    """On one device a request's inputs stay host arrays until the compiled call sends them, in its own
    dispatch (a device_put a leaf cost ~0.1 ms of host time each)."""
    _, x, _ = prefill_program(params, [[1, 2, 3]], max_new_tokens=2, sampling=Sampling(temperature=0.5),
                              stop_ids=(7,), seed=0, cache=CacheSpec(), prefill_chunk=None, mesh=None, rules=None)
    leaves = jax.tree.leaves(x)
    assert len(leaves) == 9 and all(type(leaf) is np.ndarray for leaf in leaves), [type(v) for v in leaves]


def test_consumed_carry_fails_loudly(params):
    carry = prefill(params, [np.array([1, 2, 3], np.int32)], max_new_tokens=4, sampling=Sampling(), stop_ids=(),
                    seed=0, cache=CacheSpec())
    decode(params, carry, 1)
    with pytest.raises(nemoh.StaleCarryError, match="already consumed"):
        decode(params, carry, 1)


def test_capacity_errors(params):
    with pytest.raises(nemoh.CacheCapacityError, match=r"needs 3 KV pages of 4 tokens .* holds 1 \(num_pages=1\)"):
        nemoh.generate(params, [[1, 2, 3, 4, 5]], max_new_tokens=4, cache=CacheSpec(page_size=4, num_pages=1))
    with pytest.raises(nemoh.CacheCapacityError, match="memory_budget_bytes=10"):
        nemoh.generate(params, [[1, 2, 3]], max_new_tokens=4, cache=CacheSpec(memory_budget_bytes=10))
    assert len(nemoh.generate(params, [[1, 2, 3]], max_new_tokens=4, ignore_eos=True,
                              cache=CacheSpec(memory_budget_bytes=1 << 20))[0]) == 4


def test_state_costs_traced_once_per_layout(params, monkeypatch):
    """A repeated request reads the layers' state costs without tracing their init_state again (host time
    every prefill call spent before the device started); other layers or another page size get their own."""
    from nemoh import surgery
    from nemoh.engine import carry as carry_mod

    traced, real = [], carry_mod.initial_states
    monkeypatch.setattr(carry_mod, "initial_states", lambda p, shape: traced.append(shape) or real(p, shape))
    monkeypatch.setattr(carry_mod, "_EXPECTED", {})
    first = carry_mod.state_costs(params, 4)
    assert len(traced) == 3
    assert carry_mod.state_costs(params, 4) == first and len(traced) == 3
    assert carry_mod.state_costs(params, 8) == carry_mod.StateCosts(first.per_row, 2 * first.per_page)
    no_mamba = carry_mod.state_costs(surgery.drop(params, "mamba"), 4)
    assert no_mamba.per_row < first.per_row and no_mamba.per_page == first.per_page and len(traced) == 9
    shape = traced[0]  # what a sharded request checks its carry against: the same states, not traced again
    want = jax.eval_shape(lambda: real(params, shape))
    got = carry_mod.abstract_states(params, shape)
    assert len(traced) == 9 and jax.tree.structure(got) == jax.tree.structure(want)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(got)] == [(a.shape, a.dtype) for a in jax.tree.leaves(want)]


@pytest.mark.parametrize("prompts, kwargs, match", [
    ([], {}, "non-empty list"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([[1, 256]], {}, "prompt 0: token id 256 at index \\[1\\] is outside the vocabulary"),
    ([[-3]], {}, "token id -3"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens=0"),
    ([[1, "a"]], {}, "non-integer"),
    (np.zeros((1, 2, 2), np.int32), {}, "1-D or 2-D"),
    ([[1]], {"temperature": -1.0}, "temperature=-1.0"),
    ([[1]], {"top_k": 0}, "top_k=0"),
    ([[1]], {"top_p": 1.5}, "top_p=1.5"),
    ([[1]], {"top_p": 0.0}, "top_p=0.0"),
    ([[1]], {"stop_token_ids": [999]}, r"stop_token_ids\[0\]=999: must be an integer token id"),
])
def test_bad_requests(params, prompts, kwargs, match):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(nemoh.RequestError, match=match):
        nemoh.generate(params, prompts, **kwargs)


def test_sampling_determinism_and_topk1(params):
    p = [[5, 6, 7]]
    a = nemoh.generate(params, p, max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert a == nemoh.generate(params, p, max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    others = [nemoh.generate(params, p, max_new_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (4, 5)]
    assert any(o != a for o in others)
    greedy = nemoh.generate(params, p, max_new_tokens=8, ignore_eos=True)
    assert nemoh.generate(params, p, max_new_tokens=8, temperature=1.0, top_k=1, seed=9, ignore_eos=True) == greedy


def _state(rows, temperature=1.0, top_k=None, top_p=1.0):
    return SamplingState(temperature=jnp.full((rows,), temperature, jnp.float32),
                         top_k=jnp.full((rows,), top_k or 10**6, jnp.int32),
                         top_p=jnp.full((rows,), top_p, jnp.float32),
                         keys=jnp.arange(2 * rows, dtype=jnp.uint32).reshape(rows, 2))


def test_sampled_tokens_stay_in_support():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 12)) * 2, jnp.float32)
    draw = jax.jit(jax.vmap(lambda s, n: sample(logits, s, jnp.full((4,), n, jnp.int32)), in_axes=(None, 0)))
    steps = jnp.arange(300)
    topk = np.asarray(draw(_state(4, top_k=3), steps))
    allowed = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    assert all(set(topk[:, b]) <= set(allowed[b]) for b in range(4))
    assert all(len(set(topk[:, b])) == 3 for b in range(4))
    topp = np.asarray(draw(_state(4, top_p=0.6), steps))
    probs = np.asarray(jax.nn.softmax(logits, -1))
    for b in range(4):
        order = np.argsort(-probs[b])
        before = np.cumsum(probs[b][order]) - probs[b][order]
        nucleus = set(order[before < 0.6])
        assert set(topp[:, b]) <= nucleus and len(set(topp[:, b])) == len(nucleus)
    full = np.asarray(draw(_state(4, temperature=50.0), steps))
    assert all(len(set(full[:, b])) == 12 for b in range(4))
    greedy = np.asarray(draw(_state(4, temperature=0.0), steps[:3]))
    assert (greedy == np.argmax(np.asarray(logits), -1)).all()


def test_stops_streaming_and_input_forms(params):
    greedy = nemoh.generate(params, [[5, 6, 7]], max_new_tokens=6, ignore_eos=True)[0]
    assert nemoh.generate(params, [[5, 6, 7]], max_new_tokens=6, stop_token_ids=[greedy[0]])[0] == [greedy[0]]
    assert len(greedy) == 6
    seen = []
    out = nemoh.generate(params, [[5, 6, 7], [9]], max_new_tokens=6, ignore_eos=True, steps_per_call=2,
                         on_token=lambda i, t: seen.append((i, t)))
    assert [t for i, t in seen if i == 0] == out[0] and [t for i, t in seen if i == 1] == out[1]
    two = [[5, 6, 7], [8, 9, 10]]
    r = nemoh.generate(params, two, max_new_tokens=4, ignore_eos=True)
    assert r == nemoh.generate(params, np.array(two), max_new_tokens=4, ignore_eos=True)
    assert r[:1] == nemoh.generate(params, np.array(two[0]), max_new_tokens=4, ignore_eos=True)
