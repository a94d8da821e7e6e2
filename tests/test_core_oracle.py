"""nemoh.load + nemoh.forward against transformers' logits, fp32 and bf16."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import nemoh
from nemoh import oracle

LENGTHS = (1, 3, 37, 150)  # 3 < conv_kernel; 37 not divisible by chunk_size; 150 takes the grouped MoE path


@pytest.fixture(scope="module")
def references(tiny_checkpoints):
    """name -> (prompts, fp32 oracle logits, bf16 oracle logits): one oracle call for everything."""
    rng = np.random.default_rng(0)
    prompts = {}
    for name, path in tiny_checkpoints.items():
        V = nemoh.NemotronHConfig.from_json_file(path / "config.json").vocab_size
        prompts[name] = [rng.integers(0, V, size=n).tolist() for n in LENGTHS]
    jobs = [dict(model_dir=str(p), prompts=prompts[n], dtype=dt) for dt in ("float32", "bfloat16")
            for n, p in tiny_checkpoints.items()]
    out = oracle.logits(jobs)
    k = len(tiny_checkpoints)
    return {n: (prompts[n], out[i], out[k + i]) for i, n in enumerate(tiny_checkpoints)}


def test_long_prompt_takes_the_grouped_expert_path(tiny_checkpoints, monkeypatch):
    """The longest prompt has more token-expert pairs than the gathering reference takes, so on CPU the
    oracle comparisons below cover the sorted ragged_dot path too: observe it being traced."""
    import jax
    from pallas_kernels import reference

    calls = []
    real = jax.lax.ragged_dot
    monkeypatch.setattr(jax.lax, "ragged_dot", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    params = nemoh.load(tiny_checkpoints["all_kinds"], dtype=jnp.float32)
    jax.clear_caches()
    nemoh.forward(params, np.arange(LENGTHS[-1]) % params.config.vocab_size)
    k = params.config.num_experts_per_tok
    assert LENGTHS[-1] * k > reference.GATHER_MAX_PAIRS and (LENGTHS[-1] * k, params.config.hidden_size) in calls
    calls.clear()
    nemoh.forward(params, np.arange(LENGTHS[1]))
    assert calls == []  # a short prompt gathers instead


@pytest.mark.parametrize("name", ["all_kinds", "grouped_routing", "latent_moe", "dense"])
def test_fp32_logits_match_transformers(tiny_checkpoints, references, name):
    params = nemoh.load(tiny_checkpoints[name], dtype=jnp.float32)
    prompts, ref32, _ = references[name]
    for prompt, ref in zip(prompts, ref32):
        ours = np.asarray(nemoh.forward(params, np.array(prompt))[0])
        assert ours.shape == ref.shape
        err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
        print(f"{name} len={len(prompt)} max rel err {err:.2e}")
        assert err <= 1e-4, (name, len(prompt), err)


@pytest.mark.parametrize("name", ["all_kinds", "grouped_routing", "latent_moe", "dense"])
def test_bf16_argmax_agrees_where_margin_exceeds_noise(tiny_checkpoints, references, name):
    params = nemoh.load(tiny_checkpoints[name], dtype=jnp.bfloat16)
    prompts, ref32, ref16 = references[name]
    checked = total = 0
    ours_err, hf_err = [], []  # each position's largest logit deviation from the fp32 reference
    for prompt, r32, r16 in zip(prompts, ref32, ref16):
        ours = np.asarray(nemoh.forward(params, np.array(prompt))[0])
        top2 = np.sort(r32, axis=-1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        ours_err.append(np.abs(ours - r32).max(-1))
        hf_err.append(np.abs(r16 - r32).max(-1))
        # bf16 noise: both bf16 runs' deviation from the fp32 logits, at this position's scale
        noise = 4 * np.maximum(ours_err[-1], hf_err[-1])
        sure = margin > noise
        checked += int(sure.sum())
        total += len(prompt)
        np.testing.assert_array_equal(ours.argmax(-1)[sure], r32.argmax(-1)[sure])
    typical = np.median(np.concatenate(ours_err)), np.median(np.concatenate(hf_err))
    print(f"{name}: checked {checked}/{total} positions; median bf16 deviation ours {typical[0]:.3f}, "
          f"transformers' {typical[1]:.3f}")
    assert checked > 0.5 * total
    # our bf16 path rounds no worse than transformers' own (the median: a routing flip at a near-tie,
    # which either bf16 run may take, moves single positions a lot)
    assert typical[0] <= typical[1], typical


def test_forward_rejects_out_of_range_ids(tiny_checkpoints):
    params = nemoh.load(tiny_checkpoints["dense"], dtype=jnp.float32)
    V = params.config.vocab_size
    with pytest.raises(nemoh.RequestError, match=f"token id {V} at index \\[2\\]"):
        nemoh.forward(params, [1, 2, V])
    with pytest.raises(nemoh.RequestError, match="token id -1"):
        nemoh.forward(params, [[-1, 2]])
