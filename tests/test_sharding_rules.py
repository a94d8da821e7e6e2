"""nemoh.sharding rules on abstract params (no devices needed: a mesh is its axis sizes here), and the
KV pool split with the batch. The sharded runs themselves are in tests/test_mesh.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import nemoh
from nemoh.engine.carry import StateCosts
from nemoh.engine.kv_pages import CacheSpec, block_tables, pool_sizes
from nemoh.engine.layout import chunk_width, plan
from nemoh.errors import CacheCapacityError, MeshError
from nemoh.sharding import DEFAULT_RULES, Rules
from nemoh.sharding.rules import tree_specs

CFG = nemoh.NemotronHConfig.from_dict(dict(
    vocab_size=256, hidden_size=128, hybrid_override_pattern="M*E-", mamba_num_heads=8, mamba_head_dim=16,
    ssm_state_size=16, n_groups=8, conv_kernel=4, chunk_size=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    moe_shared_expert_intermediate_size=128, moe_latent_size=64, n_group=2, topk_group=1, eos_token_id=2))


def abstract(layout: str):
    return jax.eval_shape(lambda: nemoh.random_params(CFG, layout, dtype=jnp.bfloat16))


def test_nvfp4_leaves_follow_the_logical_weight():
    specs = tree_specs(abstract("NVFP4"), DEFAULT_RULES, {"expert": 4, "tensor": 2})
    moe, mamba, attn = specs.layers[2], specs.layers[0], specs.layers[1]
    # experts_up [E, F, L]: codes [E, F, L/2], block scales transposed [E, L/16, F], global scale [E]
    assert (moe.experts_up.packed, moe.experts_up.scale, moe.experts_up.global_scale) == (
        P("expert", "tensor", None), P("expert", None, "tensor"), P("expert"))
    assert (moe.experts_down.packed, moe.experts_down.scale) == (P("expert", None, "tensor"), P("expert", "tensor", None))
    assert (moe.router, moe.latent_in.packed, moe.shared_down.scale) == (P(None, None), P(None, None), P("tensor", None))
    assert (mamba.in_proj.packed, mamba.in_proj.scale, mamba.in_proj.global_scale) == (
        P(None, "tensor"), P("tensor", None), P())  # row parallel: the input dim splits
    assert (mamba.A_log, mamba.conv_weight, mamba.out_proj.packed) == (P("tensor"), P(None, None), P(None, "tensor"))
    assert (attn.q_proj.packed, attn.k_proj.packed, attn.o_proj.scale) == (P("tensor", None), P(None, None),
                                                                           P("tensor", None))
    assert (specs.embed, specs.lm_head) == (P("tensor", None), P("tensor", None))


def test_fp8_scale_and_dense_weights():
    specs = tree_specs(abstract("FP8"), DEFAULT_RULES, {"expert": 2, "tensor": 4})
    assert (specs.layers[2].experts_up.data, specs.layers[2].experts_up.scale) == (P("expert", "tensor", None),
                                                                                 P("expert"))
    assert (specs.layers[3].up_proj.data, specs.layers[3].down_proj.scale) == (P("tensor", None), P())
    dense = tree_specs(abstract("dense"), DEFAULT_RULES, {"tensor": 8})
    assert (dense.layers[2].experts_up, dense.layers[3].down_proj) == (P(None, "tensor", None), P(None, "tensor"))


def test_what_the_mesh_lacks_is_replicated():
    specs = tree_specs(abstract("NVFP4"), DEFAULT_RULES, {"data": 2, "pipeline": 3})
    assert all(s == P(*(None,) * len(s)) for s in jax.tree.leaves(specs))


def test_indivisible_dim_names_tensor_dim_and_axis():
    with pytest.raises(MeshError, match=r"tensor embed \[256, 128\]: dim 0 \('vocab', size 256\) does not divide "
                                         r"over mesh axis 'tensor' of size 3"):
        tree_specs(abstract("dense"), DEFAULT_RULES, {"tensor": 3})
    with pytest.raises(MeshError, match=r"tensor layers\[0\]\.in_proj\.scale \(block scales, transposed: "
                                         r"\[\.\.\., in/16, out\]\) \[8, 520\]: dim 0 \('mamba_in', size 8\)"):
        tree_specs(abstract("NVFP4"), DEFAULT_RULES.with_mesh_axes(vocab=None), {"tensor": 16})


def test_a_mesh_axis_used_twice_in_one_tensor():
    with pytest.raises(MeshError, match=r"experts_up: mesh axis 'tensor' splits both dim 0 and dim 1"):
        tree_specs(abstract("dense"), DEFAULT_RULES.with_mesh_axes(experts="tensor"), {"tensor": 2})


def test_tuple_mesh_axes_split_a_dim_over_several():
    specs = tree_specs(abstract("dense"), DEFAULT_RULES.with_mesh_axes(experts=("data", "expert")),
                       {"data": 2, "expert": 4})
    assert specs.layers[2].experts_up == P(("data", "expert"), None, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scaled:
    """A user layer type."""

    norm: jax.Array
    up: jax.Array


def test_user_types_are_replicated_unless_given_rules():
    tree = (Scaled(jnp.zeros(128), jnp.zeros((64, 128))),)
    assert tree_specs(tree, DEFAULT_RULES, {"tensor": 2}) == (Scaled(P(None), P(None, None)),)
    rules = DEFAULT_RULES.with_leaf_axes({Scaled: {"up": ("mlp", "hidden")}})
    assert tree_specs(tree, rules, {"tensor": 2}) == (Scaled(P(None), P("tensor", None)),)
    assert rules == Rules.of({**{t: dict(f) for t, f in rules.leaf_axes}}, dict(rules.mesh_axes))
    assert hash(rules) == hash(DEFAULT_RULES.with_leaf_axes({"Scaled": {"up": ("mlp", "hidden")}}))


def test_bad_rules_values():
    with pytest.raises(MeshError, match=r"logical axis 'mlp' maps to 3"):
        DEFAULT_RULES.with_mesh_axes(mlp=3)
    with pytest.raises(MeshError, match=r"has 2 dims \[64, 128\], the rules give 1 logical axes"):
        tree_specs((Scaled(jnp.zeros(128), jnp.zeros((64, 128))),),
                   DEFAULT_RULES.with_leaf_axes({Scaled: {"up": ("mlp",)}}), {"tensor": 2})


def test_kv_pool_splits_with_the_batch():
    budgets = [9, 30, 2, 17, 5]  # rows 0-3 on shard 0, row 4 on shard 1
    tables = block_tables(budgets, 4, rows=8, width=8, shards=2)
    assert tables[:5, :8].tolist()[:5] == [[0, 1, 2, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8, 9, 10],
                                           [11, 0, 0, 0, 0, 0, 0, 0], [12, 13, 14, 15, 16, 0, 0, 0],
                                           [0, 1, 0, 0, 0, 0, 0, 0]]  # shard 1 numbers its own pages from 0
    assert pool_sizes(1024, CacheSpec(page_size=4), budgets, 64, rows=8, shards=2) == [64, 34]  # 2 x 17
    assert pool_sizes(1024, CacheSpec(page_size=4, num_pages=40), budgets, 64, rows=8, shards=2) == [40]
    with pytest.raises(CacheCapacityError, match=r"needs 17 KV pages of 4 tokens on one of its 2 batch shards .* "
                                                 r"holds 16 a shard \(num_pages=32\)"):
        pool_sizes(1024, CacheSpec(page_size=4, num_pages=32), budgets, 64, rows=8, shards=2)
    one = block_tables(budgets, 4, rows=8, width=8)
    assert one[4, :2].tolist() == [17, 18]  # one shard: the old numbering


def test_layout_rounds_the_batch_to_the_shards():
    device, costs = jax.devices()[0], StateCosts(per_row=4096, per_page=1024)
    assert plan(CFG, costs, [5], 4, CacheSpec(), 256, 0, device).rows == 1
    lay = plan(CFG, costs, [5], 4, CacheSpec(), 256, 0, device, shards=2)
    assert (lay.rows, lay.shards, lay.num_pages % 2) == (2, 2, 0)
    assert plan(CFG, costs, [5] * 3, 4, CacheSpec(), 256, 0, device, shards=4).rows == 16
    assert np.array_equal(block_tables([5], 16, 2, 64, 2)[1], np.zeros(64))


def test_default_prefill_chunk_follows_the_batch_slots():
    """On a GPU about 2048 prompt tokens a chunk across the slots (at least 256 a row, at most the row
    capacity); on a CPU 256; an explicit prefill_chunk wins."""
    assert [chunk_width(rows, "gpu") for rows in (1, 2, 8, 16, 64)] == [2048, 1024, 256, 256, 256]
    assert chunk_width(1, "cpu") == 256
    device, costs = jax.devices()[0], StateCosts(per_row=4096, per_page=1024)
    lay = lambda lengths, new, prefill_chunk=None: plan(CFG, costs, lengths, new, CacheSpec(), prefill_chunk, 0,
                                                        device)
    assert (lay([1500], 600).chunk, lay([1500], 600).row_tokens) == (chunk_width(1, device.platform), 4096)
    assert lay([5], 4, 64).chunk == 64
    assert lay([5], 4, 4096).chunk == 1024  # capped by the 1024-token row capacity
