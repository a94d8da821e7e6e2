"""nemoh.random_params: the loader's params structure in every quantiser layout, one value law across
layouts, finite O(1) outputs, deterministic per tensor name; and pallas_kernels stays a leaf package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nemoh
from nemoh.config import NemotronHConfig
from nemoh.io.quantize import quantize_checkpoint
from nemoh.random_params import LAYOUTS
from pallas_kernels import FP8Weight, NVFP4Weight, is_quantized

CFG = NemotronHConfig.from_dict(dict(
    vocab_size=96, hidden_size=64, hybrid_override_pattern="MEM*E-M", mamba_num_heads=4, mamba_head_dim=16,
    ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.0, eos_token_id=2))


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    """A dense fp32 checkpoint of CFG in the HF layout, the source every quantiser recipe reads."""
    return nemoh.save_hf(nemoh.random_params(CFG, dtype=jnp.float32, seed=5), tmp_path_factory.mktemp("dense"))


def _leaves(params) -> list[tuple[str, tuple, str]]:
    """(path, shape, dtype) of every array: the storage a layout gives each field."""
    return [(jax.tree_util.keystr(path), tuple(leaf.shape), str(leaf.dtype))
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_match_the_loaded_quantiser_output(layout, dense_checkpoint, tmp_path):
    """random_params(layout) has the tree (weight types included), shapes and dtypes of nemoh.load on the
    checkpoint nemoh.io.quantize writes for that recipe (the dense layout: of the dense checkpoint itself)."""
    directory = dense_checkpoint
    if layout != "dense":
        directory = tmp_path / layout
        quantize_checkpoint(dense_checkpoint, directory, layout)
    loaded = nemoh.load(directory, dtype=jnp.float32)
    made = nemoh.random_params(CFG, layout, dtype=jnp.float32, seed=3)
    assert jax.tree.structure(made) == jax.tree.structure(loaded)
    assert _leaves(made) == _leaves(loaded)
    if layout != "dense":  # the recipe quantised something
        assert any(is_quantized(w) for w in jax.tree.leaves(made, is_leaf=is_quantized))


@pytest.mark.parametrize("layout", ["dense", "MIXED"])  # MIXED holds dense, FP8 and NVFP4 projections
def test_random_model_runs_with_unit_scale_outputs(layout):
    params = nemoh.random_params(CFG, layout, dtype=jnp.float32, seed=3)
    logits = nemoh.forward(params, [[1, 2, 3, 4, 5]])
    assert bool(jnp.isfinite(logits).all())
    assert 0.3 < float(jnp.std(logits)) < 3.0  # activations stay O(1) through depth


def test_values_depend_on_seed_and_name_only():
    a = nemoh.random_params(CFG, "NANO_NVFP4", dtype=jnp.float32, seed=1)
    b = nemoh.random_params(CFG, "NANO_NVFP4", dtype=jnp.float32, seed=1)
    c = nemoh.random_params(CFG, "NANO_NVFP4", dtype=jnp.float32, seed=2)
    same = jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)
    assert all(jax.tree.leaves(same))
    assert not np.array_equal(np.asarray(a.embed), np.asarray(c.embed))
    w = a.layers[1].experts_up
    assert isinstance(w, NVFP4Weight) and w.shape == (4, 32, 64)
    assert not np.array_equal(np.asarray(w.packed[0]), np.asarray(w.packed[1]))  # experts differ


def test_every_layout_holds_the_nvfp4_values():
    """Dense projections are the NVFP4 layout's values dequantised (exact in float32), FP8 ones those values
    rounded to e4m3 (relative error <= 2**-4), each with standard deviation ~1/sqrt(in)."""
    quantized = {layout: nemoh.random_params(CFG, layout, dtype=jnp.float32, seed=4) for layout in ("NVFP4", "FP8")}
    dense = nemoh.random_params(CFG, "dense", dtype=jnp.float32, seed=4)
    for field in ("experts_up", "shared_up"):
        want = np.asarray(getattr(quantized["NVFP4"].layers[1], field).dequantize())
        np.testing.assert_array_equal(np.asarray(getattr(dense.layers[1], field)), want)
        fp8 = np.asarray(getattr(quantized["FP8"].layers[1], field).dequantize())
        np.testing.assert_allclose(fp8, want, rtol=2.0**-4, atol=0)
        assert 0.8 < want.std() * np.sqrt(want.shape[-1]) < 1.2


def test_fp8_layout_scales_are_per_expert():
    p = nemoh.random_params(CFG, "FP8", dtype=jnp.bfloat16)
    w = p.layers[1].experts_up
    assert isinstance(w, FP8Weight) and w.scale.shape == (4,) and w.data.dtype == jnp.float8_e4m3fn
    assert not is_quantized(p.lm_head) and p.lm_head.dtype == jnp.bfloat16


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layout 'NVFP8'"):
        nemoh.random_params(CFG, "NVFP8")


def test_pallas_kernels_imports_no_nemoh():
    code = "import sys, pallas_kernels; print(sorted(m for m in sys.modules if m.split('.')[0] == 'nemoh'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == "[]"
