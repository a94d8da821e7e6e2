"""Config parsing and its errors, the chunked SSD against the recurrence, checkpoint errors, the MoE
routing's top-k."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxpr_equations import equations
from safetensors.numpy import load_file, save_file

import nemoh
from nemoh import CheckpointError, ConfigError, NemotronHConfig
from nemoh.layers.ssd import _segsum, ssd_chunked, ssd_reference

DATA = Path(__file__).parent / "data"
BASE = {"vocab_size": 64, "hidden_size": 32, "hybrid_override_pattern": "M*E-", "mamba_num_heads": 4,
        "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16}


# ---- config -----------------------------------------------------------------------------------------
def test_nano_config_parses():
    cfg = NemotronHConfig.from_json_file(DATA / "nano_config.json")
    assert cfg.num_layers == 52
    assert len(cfg.layers_of("mamba")) == 23 and len(cfg.layers_of("moe")) == 23
    assert cfg.layers_of("attention") == (5, 12, 19, 26, 33, 42)


def test_both_spellings_and_aliases_agree():
    words = ["mamba", "full_attention", "moe", "mlp"]
    listed = {k: v for k, v in BASE.items() if k != "hybrid_override_pattern"}
    a = NemotronHConfig.from_dict(BASE)
    b = NemotronHConfig.from_dict({**listed, "layers_block_type": words})
    c = NemotronHConfig.from_dict({**listed, "layers_block_type": ["linear_attention", "attention", "moe", "mlp"]})
    assert a == b == c
    legacy = {k: v for k, v in BASE.items() if k not in ("n_groups", "head_dim")}
    d = NemotronHConfig.from_dict({**legacy, "mamba_n_groups": 2, "attention_head_dim": 8, "mamba_d_conv": 5,
                                   "mamba_chunk_size": 32, "mamba_conv_bias": False,
                                   "mamba_dt_limit": [0.0, {"__float__": "Infinity"}]})
    assert (d.n_groups, d.head_dim, d.conv_kernel, d.chunk_size, d.use_conv_bias) == (2, 8, 5, 32, False)
    assert d.time_step_limit == (0.0, float("inf"))


@pytest.mark.parametrize("change, match", [
    ({"hybrid_override_pattern": "M*X"}, "unknown layer kind 'X' at layer 2"),
    ({"hybrid_override_pattern": None, "layers_block_type": ["mamba", "rnn"]}, "unknown layer kind 'rnn' at layer 1"),
    ({"layers_block_type": ["mamba"]}, "disagrees with layers_block_type"),
    ({"hybrid_override_pattern": None}, "neither hybrid_override_pattern nor layers_block_type"),
    ({"mamba_num_heads": 6, "n_groups": 4}, "n_groups=4: mamba_num_heads=6 is not divisible"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_key_value_heads=4: num_attention_heads=6"),
    ({"n_routed_experts": 6, "n_group": 4, "topk_group": 1}, "n_group=4: n_routed_experts=6 is not divisible"),
    ({"n_group": 2, "topk_group": 3}, "topk_group=3: exceeds n_group=2"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ({"hidden_size": 0}, "hidden_size=0: must be a positive integer"),
    ({"head_dim": -8}, "head_dim=-8"),
    ({"eos_token_id": 64}, "eos_token_id=64 is outside the vocabulary"),
    ({"use_bias": True}, "use_bias=True"),
    ({"mamba_n_groups": 4}, "both mamba_n_groups=4 and n_groups=2"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_config_errors_name_the_culprit(change, match):
    raw = {**BASE, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace("[", r"\[")):
        NemotronHConfig.from_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json: no such file"):
        NemotronHConfig.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: unreadable JSON"):
        NemotronHConfig.from_json_file(tmp_path / "config.json")


# ---- SSD --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T, Q, G, with_state", [(37, 8, 2, True), (37, 8, 1, False), (5, 16, 2, True),
                                                 (1, 4, 2, True), (32, 8, 4, False), (150, 4, 2, True)])
def test_chunked_ssd_equals_recurrence(T, Q, G, with_state):
    k = jax.random.split(jax.random.PRNGKey(T * 10 + Q), 7)
    b, nh, hd, N = 2, 4, 3, 5
    x = jax.random.normal(k[0], (b, T, nh, hd))
    dt = jax.nn.softplus(jax.random.normal(k[1], (b, T, nh)) - 1)
    A = -jnp.exp(jax.random.normal(k[2], (nh,)))
    B = jax.random.normal(k[3], (b, T, G, N))
    C = jax.random.normal(k[4], (b, T, G, N))
    D = jax.random.normal(k[5], (nh,))
    s0 = jax.random.normal(k[6], (b, nh, hd, N)) if with_state else None
    y_ref, s_ref = ssd_reference(x, dt, A, B, C, D, s0)
    y, s = ssd_chunked(x, dt, A, B, C, D, Q, s0)
    assert float(jnp.max(jnp.abs(y - y_ref)) / jnp.max(jnp.abs(y_ref))) < 1e-5
    assert float(jnp.max(jnp.abs(s - s_ref)) / jnp.max(jnp.abs(s_ref))) < 1e-5
    # padding rows (dt = 0) leave the state unchanged
    dt0 = dt.at[:, T // 2 :].set(0.0)
    _, s_half = ssd_chunked(x[:, : T // 2 or 1], dt[:, : T // 2 or 1], A, B[:, : T // 2 or 1], C[:, : T // 2 or 1], D, Q, s0)
    if T // 2:
        _, s_pad = ssd_chunked(x, dt0, A, B, C, D, Q, s0)
        np.testing.assert_allclose(np.asarray(s_pad), np.asarray(s_half), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Q, scale, signed, spread", [(128, 0.3, False, 0), (128, 50.0, False, 0), (256, 5.0, False, 0),
                                                 (128, 1.0, False, 6), (64, 3.0, True, 0), (4, 1.0, False, 0)])
def test_segment_sums_within_two_ulps(Q, scale, signed, spread):
    """The chunk's segment sums out[l, s] = sum of a over (s, l], built from prefix sums, against float64
    sums: each within 2 ulps of its exact value (a floor of 2^-40 of the row's largest |a| aside, for
    sums of a row's tiniest entries), -inf above the diagonal. Plain differences of fp32 prefix sums miss
    this by the prefix sums' magnitude, and a sequential fp32 sum where signs cancel."""
    rng = np.random.default_rng(Q + int(scale))
    a = rng.normal(0, scale, (16, Q)) * 10.0 ** rng.integers(-spread, 1, (16, Q))
    a = (a if signed else -np.abs(a)).astype(np.float32)
    got = np.asarray(_segsum(jnp.asarray(a)), np.float64)
    prefix = np.cumsum(a.astype(np.float64), axis=-1)
    exact = prefix[:, :, None] - prefix[:, None, :]
    lower = np.tril(np.ones((Q, Q), bool))
    assert np.all(got[:, ~lower] == -np.inf)
    bound = 2.0**-22 * np.abs(exact) + 2.0**-40 * np.abs(a).max(axis=1)[:, None, None]
    assert np.all(np.abs(got - exact)[:, lower] <= bound[:, lower])
    # no Q-long sum per entry: the cumulative sums run over [..., Q] only
    sums = [e for e in equations(jax.make_jaxpr(_segsum)(jnp.asarray(a)).jaxpr) if e.primitive.name == "cumsum"]
    assert sums and all(e.invars[0].aval.shape == a.shape for e in sums)


@pytest.mark.parametrize("chunks", [16, 38])
def test_chunked_ssd_pass_unrolled_up_to_16_chunks(chunks, monkeypatch):
    """The pass from chunk to chunk holds no loop up to UNROLLED_CHUNKS chunks (a loop's trips each launch
    their kernels from the host on the GPU), loops over groups of them past that (bounded compile), and
    is the loop's arithmetic either way: the same bits as one chunk a trip."""
    from nemoh.layers import ssd

    k = jax.random.split(jax.random.PRNGKey(chunks), 6)
    b, Q, nh, hd, G, N = 1, 4, 4, 3, 2, 5
    T = chunks * Q
    args = (jax.random.normal(k[0], (b, T, nh, hd)), jax.nn.softplus(jax.random.normal(k[1], (b, T, nh))),
            -jnp.ones((nh,)), jax.random.normal(k[3], (b, T, G, N)), jax.random.normal(k[4], (b, T, G, N)),
            jnp.ones((nh,)), jax.random.normal(k[5], (b, nh, hd, N)))
    run = lambda: jax.jit(lambda x, dt, A, B, C, D, s0: ssd_chunked(x, dt, A, B, C, D, Q, s0))
    assert ("stablehlo.while" in run().lower(*args).as_text()) == (chunks > ssd.UNROLLED_CHUNKS)
    y, s = run()(*args)
    monkeypatch.setattr(ssd, "UNROLLED_CHUNKS", 1)
    y_loop, s_loop = run()(*args)
    assert np.array_equal(np.asarray(y), np.asarray(y_loop)) and np.array_equal(np.asarray(s), np.asarray(s_loop))


# ---- checkpoint errors ----------------------------------------------------------------------------
SHIPPED = Path(__file__).parents[1] / "checkpoints" / "tiny-nemotron-h"


def _copy(tmp_path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(SHIPPED, dst)
    return dst


def _edit(ck: Path, fn) -> None:
    tensors = load_file(str(ck / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(ck / "model.safetensors"))


def test_shipped_checkpoint_loads_and_runs():
    params = nemoh.load(SHIPPED, dtype=jnp.bfloat16)
    assert params.embed.dtype == jnp.bfloat16
    moe = next(l for l in params.layers if type(l).__name__ == "MoEParams")
    assert moe.router.dtype == jnp.float32 and moe.experts_up.ndim == 3
    assert nemoh.forward(params, [1, 2, 3]).shape == (1, 3, params.config.vocab_size)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("backbone.layers.0.mixer.D"), "tensor backbone.layers.0.mixer.D is missing"),
    (lambda t: t.update({"backbone.layers.0.mixer.extra": np.zeros(3, np.float32)}),
     r"unexpected tensors .*backbone.layers.0.mixer.extra \(in model.safetensors\)"),
    (lambda t: t.update({"backbone.norm_f.weight": np.zeros(7, np.float32)}),
     r"tensor backbone.norm_f.weight in model.safetensors: shape \[7\]"),
    (lambda t: t.update({"backbone.norm_f.weight": t["backbone.norm_f.weight"].astype(np.int32)}),
     "tensor backbone.norm_f.weight in model.safetensors: dtype I32"),
])
def test_checkpoint_errors_name_tensor_and_file(tmp_path, edit, match):
    ck = _copy(tmp_path)
    _edit(ck, edit)
    with pytest.raises(CheckpointError, match=match):
        nemoh.load(ck)


def test_corrupt_and_missing_files(tmp_path):
    ck = _copy(tmp_path)
    (ck / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable safetensors file"):
        nemoh.load(ck)
    with pytest.raises(CheckpointError, match="does not exist"):
        nemoh.load(tmp_path / "nowhere")
    (ck / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json: no such file"):
        nemoh.load(ck)


def test_sharded_checkpoint_and_index_errors(tmp_path):
    ck = _copy(tmp_path)
    tensors = load_file(str(ck / "model.safetensors"))
    (ck / "model.safetensors").unlink()
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for fname, part in half.items():
        save_file({n: tensors[n] for n in part}, str(ck / fname))
    index = {"weight_map": {n: f for f, part in half.items() for n in part}}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    a = nemoh.load(ck, dtype=jnp.float32)
    b = nemoh.load(SHIPPED, dtype=jnp.float32)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    wrong = dict(index["weight_map"])
    wrong[names[0]] = "model-00002-of-00002.safetensors"
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(CheckpointError, match=f"tensor {names[0]}: model.safetensors.index.json names"):
        nemoh.load(ck)
    (ck / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors listed"):
        nemoh.load(ck)


def test_embedding_spelling_and_no_pickle(tmp_path):
    ck = _copy(tmp_path)
    _edit(ck, lambda t: t.update({"backbone.embedding.weight": t.pop("backbone.embeddings.weight")}))
    (ck / "pytorch_model.bin").write_bytes(b"garbage that must never be unpickled")
    params = nemoh.load(ck, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(params.embed), np.asarray(nemoh.load(SHIPPED, dtype=jnp.float32).embed))


@settings(derandomize=True, deadline=None, database=None, max_examples=60)
@given(st.lists(st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.0, 3.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -2.5]),
                min_size=1, max_size=24),
       st.integers(1, 24), st.integers(1, 3))
def test_ranked_top_k_is_lax_top_k(values, k, rows):
    """The MoE routing's top-k (ranks from one compare-and-count, no sort) picks exactly lax.top_k's
    entries in its order: ties (lower index first), signed zeros, infinities, NaNs of both signs and
    subnormals, over leading dims."""
    from nemoh.layers.moe import ranked_top_k

    x = jnp.asarray(np.stack([np.roll(np.asarray(values, np.float32), r) for r in range(rows)]))
    k = min(k, x.shape[-1])
    want_v, want_i = jax.lax.top_k(x, k)
    got_v, got_i = ranked_top_k(x, k)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.int32), np.asarray(want_v).view(np.int32))


def test_routing_top_k_ranks_decode_batches_and_sorts_prefill_chunks():
    """The routing's top-k ranks a decode batch's scores (no sort on the MoE layer's critical path) and
    leaves long prefill chunks to lax.top_k, whose cost does not grow with E per entry; equal results."""
    from nemoh.layers import moe

    rng = np.random.default_rng(3)
    for tokens, expect_sort in ((64, False), (4096, True)):
        x = jnp.asarray(np.round(rng.normal(size=(tokens, 128)) * 2).astype(np.float32))  # ties
        primitives = str(jax.make_jaxpr(lambda v: moe.top_k(v, 6))(x))
        assert ("top_k" in primitives) == expect_sort, tokens
        got, want = moe.top_k(x, 6), jax.lax.top_k(x, 6)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_router_logits_reduce_decode_batches_and_multiply_prefill_chunks():
    """Router logits are full float32 products either way: a decode batch's as one multiply-and-sum
    reduction (no float32 GEMM launch), a long prefill chunk's as a dot; both against float64 products."""
    from nemoh.layers import moe

    rng = np.random.default_rng(5)
    router = jnp.asarray(rng.normal(size=(128, 2688)) / 50, jnp.bfloat16)
    for tokens, expect_dot in ((moe.ROUTER_REDUCE_TOKENS, False), (moe.ROUTER_REDUCE_TOKENS + 1, True)):
        x = jnp.asarray(rng.normal(size=(tokens, 2688)), jnp.bfloat16)
        primitives = str(jax.make_jaxpr(moe.router_logits)(x, router))
        assert ("dot_general" in primitives) == expect_dot, tokens
        want = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
        np.testing.assert_allclose(np.asarray(moe.router_logits(x, router)), want, rtol=0, atol=2e-5)
