"""NVIDIA ModelOpt 0.47 exports, read exactly as the tool wrote them.

tests/data/modelopt/ holds `export_hf_checkpoint` output for a tiny random NemotronH (every layer kind) under
nine recipes, fp32 and bf16, with reference logits from ModelOpt's own quantised model; it was made once by
scripts/make_modelopt_fixtures.py (which documents the references), so CI never installs ModelOpt. The
configs are unmodified: their module names carry ModelOpt's garbled export marker.

Tolerances (fp32 logits of O(1-10); nemoh loads every export, bf16 ones included, in float32):
  weight-only: nemoh and the reference compute the same function on the same weights, differing only in
    summation order (XLA vs torch) and the SSD / attention formulation: 1e-4 absolute (measured <= 1.3e-5).
  activation_quant: the same, except that quantising activations is a step function: an activation that
    lies within fp32 rounding noise (~1e-6 relative, from the different summation orders) of an FP8 /
    e2m1 rounding boundary can round either way, and that one flip shifts the logits of its own and later
    positions (up to 0.35 measured on this tiny model, W8A8). So: every greedy token equal, at least half
    of all positions within 1e-4 (no flip upstream; 97% measured over the fixtures), none off by more than
    0.5 -- while ignoring activation quantisation (weight-only) misses the reference by a median >= 0.1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import nemoh
from nemoh.errors import CheckpointError
from nemoh.io.modelopt import normalise_module_name
from nemoh.io.quantize import quantize_checkpoint
from nemoh.io.tensor_source import TensorSource
from pallas_kernels import FP8Weight, NVFP4Weight

DATA = Path(__file__).parent / "data" / "modelopt"
RECIPES = ("nvfp4", "fp8", "w4a16_nvfp4", "mamba_moe_nvfp4_conservative", "mamba_moe_nvfp4_aggressive",
           "mamba_moe_fp8_conservative", "mamba_moe_fp8_aggressive", "mixed_precision", "nvfp4_fp8_kv")
FIXTURES = [f"{r}-{d}" for r in RECIPES for d in ("fp32", "bf16")]
# each params structure costs a compile (~7 s on CPU): activation quantisation is checked on the FP8, NVFP4
# (also with its FP8 KV cache) and mixed exports, and on the Mamba-MoE FP8 one, where a flip happens
ACTIVATION_QUANT = [f"{r}-{d}" for r in ("nvfp4", "fp8", "mixed_precision", "nvfp4_fp8_kv", "mamba_moe_fp8_conservative")
                    for d in ("fp32", "bf16")]
# ModelOpt recipe -> (nemoh.io.quantize recipe, calibrated); the FP8 KV-cache one has no nemoh counterpart
SAME_RECIPE = {"nvfp4": ("NVFP4", True), "w4a16_nvfp4": ("NVFP4", False), "fp8": ("FP8", True),
               "mixed_precision": ("MIXED", True),
               **{r: (r.upper(), True) for r in RECIPES if r.startswith("mamba_moe_")}}
MARKER = ".\x00backbone.pt_name_sentinel"
WEIGHT_ONLY_TOL, FLIP_FREE_TOL, FLIP_BOUND = 1e-4, 1e-4, 0.5


def reference(name: str, mode: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(tokens int32 [2, 24], logits float32 [2, 24, V], prompt lengths) of one fixture's reference."""
    with np.load(DATA / name / "reference.npz") as npz:
        tokens, logits = npz[f"tokens_{mode}"], npz[f"logits_{mode}"]
    return tokens, logits, json.loads((DATA / name / "reference.json").read_text())["prompt_lengths"]


def greedy_mismatches(logits: np.ndarray, tokens: np.ndarray, prompt_lengths: list[int]) -> list[tuple[int, int]]:
    """(row, position) where argmax of the logits is not the next token of the greedy continuation:
    none means greedy decoding from the prompt gives exactly these tokens."""
    pick = logits.argmax(-1)
    return [(b, t) for b, p in enumerate(prompt_lengths) for t in range(p - 1, tokens.shape[1] - 1)
            if pick[b, t] != tokens[b, t + 1]]


def quantised_kinds(params) -> set[str]:
    leaves = [params.lm_head, *(w for layer in params.layers for w in vars(layer).values())]
    return {type(w).__name__ for w in leaves if isinstance(w, (FP8Weight, NVFP4Weight))}


def test_every_fixture_is_there_and_small():
    made = {p.name for p in DATA.iterdir() if p.is_dir()}
    assert made == set(FIXTURES) | {"dense-fp32", "dense-bf16"}
    for name in made:
        size = sum(f.stat().st_size for f in (DATA / name).iterdir())
        assert size < 400_000, (name, size)


@pytest.mark.parametrize("name", FIXTURES)
def test_export_loads_unmodified_and_matches_weight_only_reference(name):
    raw = (DATA / name / "hf_quant_config.json").read_text()
    assert "\\u0000backbone.pt_name_sentinel" in raw  # as ModelOpt 0.47 wrote it, marker and all
    assert json.loads((DATA / name / "reference.json").read_text())["versions"]["modelopt"] == "0.47.0"
    params = nemoh.load(DATA / name, dtype=jnp.float32)
    assert quantised_kinds(params) == ({"FP8Weight"} if "fp8" in name and "kv" not in name else
                                       {"FP8Weight", "NVFP4Weight"} if "mixed" in name else {"NVFP4Weight"})
    tokens, ref, prompts = reference(name, "w")
    assert not greedy_mismatches(ref, tokens, prompts)  # the fixture is self-consistent
    logits = np.asarray(nemoh.forward(params, tokens))
    err = np.abs(logits - ref).max()
    assert err <= WEIGHT_ONLY_TOL, (name, err)
    assert not greedy_mismatches(logits, tokens, prompts)


@pytest.mark.parametrize("name", ACTIVATION_QUANT)
def test_activation_quant_matches_modelopt_fake_quant(name):
    params = nemoh.load(DATA / name, dtype=jnp.float32, activation_quant=True)
    scaled = [w for layer in params.layers for w in vars(layer).values() if getattr(w, "input_scale", None) is not None]
    assert scaled and params.lm_head is not None and not hasattr(params.lm_head, "input_scale")
    tokens, ref, prompts = reference(name, "wa")
    logits = np.asarray(nemoh.forward(params, tokens))
    err = np.abs(logits - ref).max(-1)  # per position [2, 24]
    assert not greedy_mismatches(logits, tokens, prompts), name
    assert np.mean(err <= FLIP_FREE_TOL) >= 0.5 and err.max() <= FLIP_BOUND, (name, np.round(err, 6))
    weight_only = np.asarray(nemoh.forward(nemoh.load(DATA / name, dtype=jnp.float32), tokens))
    assert np.median(np.abs(weight_only - ref).max(-1)) >= 0.1, name


def test_weight_only_recipe_is_weight_only_with_activation_quant():
    name = "w4a16_nvfp4-fp32"
    params = nemoh.load(DATA / name, dtype=jnp.float32, activation_quant=True)
    assert all(getattr(w, "input_scale", None) is None for layer in params.layers for w in vars(layer).values())
    tokens, ref, _ = reference(name, "w")
    assert np.abs(np.asarray(nemoh.forward(params, tokens)) - ref).max() <= WEIGHT_ONLY_TOL


def _copy(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    return out


def _edit_quant(directory: Path, change) -> None:
    path = directory / "hf_quant_config.json"
    raw = json.loads(path.read_text())
    change(raw["quantization"])
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("name,change,match", [
    ("nvfp4-fp32", lambda q: q["exclude_modules"].remove("lm_head" + MARKER),
     r"lm_head\.weight in model\.safetensors: stored dense \(F32\) where .*hf_quant_config\.json says lm_head is NVFP4"),
    ("fp8-bf16", lambda q: q["exclude_modules"].append("backbone.layers.0.mixer.in_proj" + MARKER),
     r"backbone\.layers\.0\.mixer\.in_proj\.weight in model\.safetensors: quantised tensor where the config says "
     r"excluded"),
    ("mamba_moe_nvfp4_conservative-fp32", lambda q: q["exclude_modules"].remove("backbone.layers.0" + MARKER + "*"),
     r"backbone\.layers\.0\.mixer\.in_proj\.weight in model\.safetensors: stored dense \(F32\)"),
    ("mixed_precision-fp32",
     lambda q: q["quantized_layers"].__setitem__("backbone.layers.2.mixer.experts" + MARKER, {"quant_algo": "FP8"}),
     r"backbone\.layers\.2\.mixer\.experts\.0\.up_proj\.weight in model\.safetensors: dtype U8, expected one of "
     r"\['F8_E4M3'\]"),
    ("nvfp4-fp32", lambda q: q["exclude_modules"].append("backbone.layers.1.\x00mixer" + MARKER),
     r"module name .* holds a NUL byte that is not ModelOpt's name marker"),
])
def test_config_that_contradicts_its_tensors_still_raises(tmp_path, name, change, match):
    directory = _copy(name, tmp_path)
    _edit_quant(directory, change)
    with pytest.raises(CheckpointError, match=match):
        nemoh.load(directory, dtype=jnp.float32)


def test_missing_input_scale_raises_only_with_activation_quant(tmp_path):
    directory = _copy("fp8-fp32", tmp_path)
    src = TensorSource(directory)
    gone = "backbone.layers.4.mixer.down_proj.input_scale"
    save_file({n: src.get(n) for n in src.names() if n != gone}, str(directory / "model.safetensors"))
    assert quantised_kinds(nemoh.load(directory, dtype=jnp.float32)) == {"FP8Weight"}
    with pytest.raises(CheckpointError, match=rf"tensor {gone} is missing .* quantises the activations"):
        nemoh.load(directory, dtype=jnp.float32, activation_quant=True)


def _normalised(obj):
    """A config with ModelOpt's name marker cut off every module name, lists of names sorted, no producer."""
    if isinstance(obj, dict):
        return {_normalised(k): _normalised(v) for k, v in obj.items() if k != "producer"}
    if isinstance(obj, list):
        items = [_normalised(v) for v in obj]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    return normalise_module_name(obj, "test") if isinstance(obj, str) else obj


@pytest.mark.parametrize("recipe", sorted(SAME_RECIPE))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_quantiser_writes_what_modelopt_writes(tmp_path, recipe, dtype):
    """nemoh.io.quantize on the dense checkpoint ModelOpt started from, with ModelOpt's calibration amax:
    every tensor byte for byte, and the same quantisation config fields."""
    assert set(RECIPES) - set(SAME_RECIPE) == {"nvfp4_fp8_kv"}  # nemoh writes no KV-cache scales
    export = DATA / f"{recipe}-{dtype}"
    algo, calibrated = SAME_RECIPE[recipe]
    amax = json.loads((export / "input_amax.json").read_text()) if calibrated else None
    quantize_checkpoint(DATA / f"dense-{dtype}", tmp_path / "q", algo, input_amax=amax)
    ours, theirs = TensorSource(tmp_path / "q"), TensorSource(export)
    assert ours.names() == theirs.names()
    for n in sorted(theirs.names()):
        assert (ours.dtype_of(n), ours.get(n).tobytes()) == (theirs.dtype_of(n), theirs.get(n).tobytes()), n
    for file, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        mine, modelopt = (json.loads((d / file).read_text())[key] for d in (tmp_path / "q", export))
        assert _normalised(mine) == _normalised(modelopt), file
