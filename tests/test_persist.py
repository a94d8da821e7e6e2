"""nemoh.save / load of a saved directory (orbax) and nemoh.save_hf: bit-identical round trips for dense,
FP8 and NVFP4 params and user layer types; save_hf output read by transformers and byte-identical to the
quantiser's files; named refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nemoh
from nemoh import oracle
from nemoh.io.quantize import quantize_checkpoint
from nemoh.io.tensor_source import TensorSource
from nemoh.layers.context import TokenContext

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-nemotron-h"

TINY = dict(vocab_size=96, hidden_size=64, hybrid_override_pattern="MEM*E-", mamba_num_heads=4, mamba_head_dim=16,
            ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, eos_token_id=2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledMLP:
    """A user layer type (importable: defined at module level)."""

    norm: jax.Array
    up: jax.Array
    scale: jax.Array


def _identical(a, b) -> bool:
    same = jax.tree.map(lambda x, y: x.dtype == y.dtype and bool(jnp.array_equal(x, y)), a, b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(jax.tree.leaves(same))


@pytest.mark.parametrize("layout", ["dense", "FP8", "NANO_NVFP4", "MIXED"])
def test_orbax_round_trip_is_bit_identical(tmp_path, layout):
    cfg = nemoh.NemotronHConfig.from_dict(TINY)
    params = nemoh.random_params(cfg, layout, dtype=jnp.bfloat16, seed=4)
    if layout == "MIXED":  # and a user layer type in place of the MLP
        layers = list(params.layers)
        layers[5] = ScaledMLP(layers[5].norm, layers[5].up_proj, jnp.float32(0.5))
        params = dataclasses.replace(params, layers=tuple(layers))
    nemoh.save(params, tmp_path / "saved")
    back = nemoh.load(tmp_path / "saved")
    assert _identical(params, back) and back.config == params.config


def test_saved_directory_refuses_another_dtype_and_local_types(tmp_path):
    params = nemoh.random_params(nemoh.NemotronHConfig.from_dict(TINY), "dense", dtype=jnp.float32)
    nemoh.save(params, tmp_path / "saved")
    with pytest.raises(nemoh.CheckpointError, match="saved in float32"):
        nemoh.load(tmp_path / "saved", dtype=jnp.bfloat16)

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Local:
        norm: jax.Array

    layers = list(params.layers)
    layers[2] = Local(layers[2].norm)
    with pytest.raises(nemoh.CheckpointError, match="layer 2 \\(Local\\).*importable"):
        nemoh.save(dataclasses.replace(params, layers=tuple(layers)), tmp_path / "other")
    with pytest.raises(nemoh.CheckpointError, match="not empty"):
        nemoh.save(params, tmp_path / "saved")


def test_save_hf_dense_reads_in_transformers_and_back(tiny_checkpoints, tmp_path):
    params = nemoh.load(tiny_checkpoints["all_kinds"], dtype=jnp.float32)
    out = nemoh.save_hf(params, tmp_path / "hf")
    assert _identical(params, nemoh.load(out, dtype=jnp.float32))
    assert json.loads((out / "config.json").read_text())["time_step_min"] <= 1e-6  # unused fields carried
    prompt = list(range(3, 40))
    ref = oracle.logits([dict(model_dir=str(out), prompts=[prompt], dtype="float32")])[0][0]
    ours = np.asarray(nemoh.forward(params, [prompt])[0])
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 1e-4


def test_save_hf_quantised_writes_the_loaded_bytes(tiny_checkpoints, tmp_path):
    qdir = tmp_path / "mixed"
    quantize_checkpoint(tiny_checkpoints["all_kinds"], qdir, "MIXED")
    out = nemoh.save_hf(nemoh.load(qdir, dtype=jnp.float32), tmp_path / "again")
    src, dst = TensorSource(qdir), TensorSource(out)
    assert src.names() == dst.names()
    for name in src.names():
        a, b = src.get(name), dst.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    spec = lambda d: json.loads((d / "hf_quant_config.json").read_text())["quantization"]
    assert spec(out)["quant_algo"] == "MIXED_PRECISION"
    assert spec(out)["quantized_layers"] == spec(qdir)["quantized_layers"]


def test_loaded_random_and_restored_params_lower_to_one_program(tmp_path):
    """jit (and the persistent compilation cache, keyed by the lowered program) sees params from
    safetensors, from random_params and from an orbax restore alike: all committed to their device."""
    loaded = nemoh.load(SHIPPED, jnp.float32)
    nemoh.save(loaded, tmp_path / "saved")
    restored = nemoh.load(tmp_path / "saved")
    drawn = nemoh.random_params(loaded.config, "dense", dtype=jnp.float32)

    @jax.jit
    def hidden(params, tokens):
        return nemoh.model.run_layers(params, tokens, TokenContext.full(*tokens.shape), None)[0]

    tokens = jnp.ones((1, 8), jnp.int32)
    programs = {hidden.lower(p, tokens).as_text() for p in (loaded, restored, drawn)}
    assert len(programs) == 1
