"""ModelOpt checkpoint I/O: the quantiser's bits, the numpy dequantiser, QuantSpec and read_linear.

Every checkpoint here is a tiny random NemotronH in the Hugging Face layout (reference/nemotron_h.md),
written by the test itself with safetensors.numpy.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import nemoh
from nemoh.config import NemotronHConfig
from nemoh.errors import CheckpointError
from nemoh.io import dequantize as dq
from nemoh.io import quantize as qz
from nemoh.io.modelopt import QuantSpec, normalise_module_name, read_kv_scales, read_linear
from nemoh.io.tensor_source import TensorSource
from pallas_kernels.formats import E2M1_VALUES as JNP_TABLE
from pallas_kernels import FP8Weight, NVFP4Weight, dequantize

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "vocab_size": 64, "hidden_size": 32, "hybrid_override_pattern": "MEM*MEM-",
    "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2, "conv_kernel": 4,
    "chunk_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "intermediate_size": 48, "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False, "rope_theta": 10000,
}
PREFIX = "backbone.layers"


def dense_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors with the names and shapes of nemotron_h.md (bf16; router gate and bias f32)."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, hd, G, N = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"]
    I, K = nh * hd, cfg["conv_kernel"]
    conv_dim = I + 2 * G * N
    Hq, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, F, Fs = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["moe_shared_expert_intermediate_size"]
    L = cfg.get("moe_latent_size")

    def r(*shape, dtype=BF16):
        return (rng.normal(size=shape) * 0.1).astype(dtype)

    t = {"backbone.embeddings.weight": r(V, H), "backbone.norm_f.weight": r(H), "lm_head.weight": r(V, H)}
    for i, kind in enumerate(cfg["hybrid_override_pattern"]):
        m = f"{PREFIX}.{i}.mixer."
        t[f"{PREFIX}.{i}.norm.weight"] = r(H)
        if kind == "M":
            t.update({m + "in_proj.weight": r(2 * I + 2 * G * N + nh, H), m + "conv1d.weight": r(conv_dim, 1, K),
                      m + "conv1d.bias": r(conv_dim), m + "A_log": r(nh, dtype=np.float32), m + "D": r(nh),
                      m + "dt_bias": r(nh), m + "norm.weight": r(I), m + "out_proj.weight": r(H, I)})
        elif kind == "*":
            t.update({m + "q_proj.weight": r(Hq * D, H), m + "k_proj.weight": r(Hkv * D, H),
                      m + "v_proj.weight": r(Hkv * D, H), m + "o_proj.weight": r(H, Hq * D)})
        elif kind == "E":
            width = L or H
            t.update({m + "gate.weight": r(E, H, dtype=np.float32),
                      m + "gate.e_score_correction_bias": r(E, dtype=np.float32),
                      m + "shared_experts.up_proj.weight": r(Fs, H), m + "shared_experts.down_proj.weight": r(H, Fs)})
            for j in range(E):
                t[m + f"experts.{j}.up_proj.weight"] = r(F, width)
                t[m + f"experts.{j}.down_proj.weight"] = r(width, F)
            if L:
                t[m + "fc1_latent_proj.weight"] = r(L, H)
                t[m + "fc2_latent_proj.weight"] = r(H, L)
        else:
            t.update({m + "up_proj.weight": r(cfg["intermediate_size"], H),
                      m + "down_proj.weight": r(H, cfg["intermediate_size"])})
    return t


def write_dense(directory: Path, cfg: dict | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    cfg = cfg or CONFIG
    directory.mkdir(parents=True)
    tensors = dense_tensors(cfg, seed)
    (directory / "config.json").write_text(json.dumps(cfg))
    (directory / "tokenizer.json").write_text("{}")
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def all_tensors(directory: Path) -> dict[str, np.ndarray]:
    src = TensorSource(directory)
    return {n: src.get(n) for n in sorted(src.names())}


def rewrite_tensors(directory: Path, change) -> None:
    """Apply `change(tensors)` (in place) to a single-file checkpoint."""
    tensors = all_tensors(directory)
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def edit_json(path: Path, change) -> None:
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def quantized(tmp_path: Path, algo: str, cfg: dict | None = None, **kw) -> tuple[Path, dict[str, np.ndarray]]:
    dense = write_dense(tmp_path / "dense", cfg)
    qz.quantize_checkpoint(tmp_path / "dense", tmp_path / algo, algo, **kw)
    return tmp_path / algo, dense


def f32_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def linears(cfg: dict | None = None) -> list[str]:
    return qz.linear_modules(NemotronHConfig.from_dict(cfg or CONFIG))


def read_all_linears(directory: Path, dense: dict[str, np.ndarray]) -> dict[str, object]:
    src, spec = TensorSource(directory), QuantSpec.from_dir(directory)
    return {m: read_linear(src, m, spec, dense[m + ".weight"].shape, jnp.bfloat16) for m in linears()}


# ---- format bits --------------------------------------------------------------------------------------

def test_e2m1_table_from_bits_matches_spec_and_jnp_table():
    spec = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    np.testing.assert_array_equal(qz.E2M1_VALUES[:8], spec)
    np.testing.assert_array_equal(qz.E2M1_VALUES[8:], -np.array(spec, np.float32))
    assert np.signbit(qz.E2M1_VALUES[8])
    np.testing.assert_array_equal(f32_bits(qz.E2M1_VALUES), f32_bits(JNP_TABLE))


def test_e2m1_rounding_nearest_even_ties_and_saturation():
    x = np.array([0.0, 0.25, 0.26, 0.74, 0.75, 1.25, 1.26, 1.75, 2.5, 2.6, 3.5, 5.0, 5.01, 7.0, 100.0,
                  -0.0, -0.2, -0.75, -1.75, -5.0, -9.0], np.float32)
    want = [0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 7,
            0, 8, 10, 12, 14, 15]
    np.testing.assert_array_equal(qz.e2m1_encode(x), want)
    # every grid value encodes to itself
    np.testing.assert_array_equal(qz.e2m1_encode(qz.E2M1_VALUES), [*range(8), 0, *range(9, 16)])


def test_nibble_order_low_nibble_is_even_index():
    codes = np.array([[1, 2, 15, 0, 7, 8]], np.uint8)
    np.testing.assert_array_equal(qz.pack_nibbles(codes), [[0x21, 0x0F, 0x87]])
    np.testing.assert_array_equal(dq.unpack_nibbles(qz.pack_nibbles(codes)), codes)


def test_nvfp4_bits_on_hand_built_weight():
    """global 2^-10; block 0 scale 448 (S = 0.4375), block 1 scale 1.0 (S = 2^-10): codes known exactly."""
    e0 = [6, -3, 0.5, 1, 1.5, 2, 3, 4, 0, -0.5, -1, -1.5, -2, -4, -6, 0]
    e1 = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.75, -0.1, 5.5, 0.3, -0.0, 2.75, -5, 0]
    w = np.concatenate([np.array(e0) * 0.4375, np.array(e1) * 2.0**-10]).astype(np.float32)[None]
    packed, block, glob = qz.nvfp4_quantize(w)
    assert packed.dtype == np.uint8 and packed.shape == (1, 16)
    assert block.dtype == FP8 and block.shape == (1, 2)
    assert glob.dtype == np.float32 and glob.shape == () and glob == np.float32(2.0**-10)
    np.testing.assert_array_equal(block.view(np.uint8), [[0x7E, 0x38]])  # fp8 448 and 1.0
    np.testing.assert_array_equal(
        packed, [[0xD7, 0x21, 0x43, 0x65, 0x90, 0xBA, 0xEC, 0x0F,
                  0x07, 0x22, 0x44, 0x66, 0x8A, 0x17, 0x50, 0x0E]])


def test_nvfp4_zero_and_tiny_blocks_give_no_nan():
    w = np.zeros((2, 32), np.float32)
    w[0, 16:] = np.linspace(-1, 1, 16)
    w[1, 16:] = 1e-6  # far below global/448: block scale clamps to the smallest fp8 subnormal, not 0
    packed, block, glob = qz.nvfp4_quantize(w)
    assert block.view(np.uint8)[0, 0] == 0x38 and block.view(np.uint8)[1, 0] == 0x38  # zero block -> 1.0
    assert block.view(np.uint8)[1, 1] == 0x01  # 2^-9
    np.testing.assert_array_equal(packed[:, :8], 0)
    out = dq.nvfp4_dequantize(packed, block, glob)
    assert np.isfinite(out).all() and (out[:, :16] == 0).all()
    # an all-zero tensor: global scale 0, still no NaN anywhere
    packed, block, glob = qz.nvfp4_quantize(np.zeros((3, 16), np.float32))
    assert glob == 0 and (packed == 0).all() and not np.isnan(block.astype(np.float32)).any()
    assert (dq.nvfp4_dequantize(packed, block, glob) == 0).all()
    data, scale = qz.fp8_quantize(np.zeros((2, 4), np.float32))
    assert scale == 0 and (data.astype(np.float32) == 0).all()


def test_fp8_bits_rounding_and_saturation():
    w = np.array([[448, -448, 1, 0.5, 300, 1.0625, 1.1875, 0]], np.float32)
    data, scale = qz.fp8_quantize(w)
    assert scale.dtype == np.float32 and scale.shape == () and scale == 1.0
    np.testing.assert_array_equal(data.view(np.uint8), [[0x7E, 0xFE, 0x38, 0x30, 0x79, 0x38, 0x3A, 0x00]])
    data, scale = qz.fp8_quantize(np.array([[896.0, 1000.0 / 3]], np.float32))
    assert scale == np.float32(896.0) / np.float32(448.0)
    assert np.isfinite(data.astype(np.float32)).all() and data.astype(np.float32)[0, 0] == 448


def test_quantise_dequantise_error_bounds():
    rng = np.random.default_rng(1)
    w = (rng.standard_t(4, size=(64, 128)) * 0.05).astype(np.float32)
    packed, block, glob = qz.nvfp4_quantize(w)
    err = np.abs(dq.nvfp4_dequantize(packed, block, glob) - w)
    step = np.repeat(block.astype(np.float32) * glob, 16, axis=-1)  # effective scale S of each element
    assert (err <= step * 1.0 + 1e-12).all()  # half the widest e2m1 gap (4 -> 6) is 1 * S
    assert np.linalg.norm(err) / np.linalg.norm(w) < 0.12
    data, scale = qz.fp8_quantize(w)
    err = np.abs(dq.fp8_dequantize(data, scale) - w)
    assert (err <= np.abs(w) * 2.0**-4 + scale * 2.0**-10 + 1e-12).all()


def test_numpy_dequant_equals_jnp_dequantize_bit_for_bit():
    rng = np.random.default_rng(2)
    stacks = [qz.nvfp4_quantize((rng.normal(size=(24, 48)) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32))
              for _ in range(3)]
    packed, block, glob = (np.stack(parts) for parts in zip(*stacks))  # [E, out, ...] like stacked experts
    ref = dq.nvfp4_dequantize(packed, block, glob)
    weight = NVFP4Weight.from_hf(packed, block, glob)
    np.testing.assert_array_equal(f32_bits(dequantize(weight)), f32_bits(ref))
    back = weight.to_hf()  # the kernel layout converts back to the stored tensors exactly
    for name, stored in (("weight", packed), ("weight_scale", block), ("weight_scale_2", glob)):
        np.testing.assert_array_equal(np.asarray(back[name]).view(np.uint8), stored.view(np.uint8))
    for i in range(3):
        np.testing.assert_array_equal(f32_bits(dq.nvfp4_dequantize(*stacks[i])), f32_bits(ref[i]))
    data, scale = qz.fp8_quantize(rng.normal(size=(24, 48)).astype(np.float32))
    got = dequantize(FP8Weight.from_hf(data, scale))
    np.testing.assert_array_equal(f32_bits(got), f32_bits(dq.fp8_dequantize(data, scale)))


# ---- quantiser, reader, dequantiser ------------------------------------------------------------------

def test_linear_and_config_modules():
    cfg = NemotronHConfig.from_dict({**CONFIG, "moe_latent_size": 16})
    modules = qz.linear_modules(cfg)
    assert "lm_head" in modules and f"{PREFIX}.1.mixer.fc1_latent_proj" in modules
    assert f"{PREFIX}.1.mixer.experts.3.down_proj" in modules and f"{PREFIX}.7.mixer.up_proj" in modules
    assert not any(s in m for m in modules for s in ("conv1d", "gate", "embeddings", "norm"))
    assert len(modules) == 1 + 4 * 2 + 4 + 2 * (2 + 2 * 4 + 2) + 2
    named = qz.config_modules(cfg)  # what ModelOpt's configs name: experts as one module, non-linear modules too
    assert {"backbone.embeddings", f"{PREFIX}.0.mixer.conv1d", f"{PREFIX}.1.mixer.gate",
            f"{PREFIX}.1.mixer.experts"} <= set(named)
    assert not any(".experts." in m or m.endswith("norm") for m in named)
    assert len(named) == len(modules) - 2 * 8 + 2 + 1 + 4 + 2  # 2 layers' 8 expert modules -> 2; embeddings, 4 conv1d, 2 gates


@pytest.mark.parametrize("algo,fmt", [("NVFP4", NVFP4Weight), ("FP8", FP8Weight)])
def test_read_linear_types_and_shapes(tmp_path, algo, fmt):
    qdir, dense = quantized(tmp_path, algo)
    spec = QuantSpec.from_dir(qdir)
    assert spec.quant_algo == {"NVFP4": "W4A16_NVFP4", "FP8": "FP8"}[algo] and "lm_head" in spec.exclude
    src = TensorSource(qdir)
    m = f"{PREFIX}.1.mixer.experts.3.up_proj"
    w = read_linear(src, m, spec, (32, 32), jnp.bfloat16)
    assert isinstance(w, fmt) and w.shape == (32, 32)
    if algo == "NVFP4":
        assert (w.packed.dtype, w.packed.shape) == (jnp.uint8, (32, 16))
        assert (w.scale.dtype, w.scale.shape) == (jnp.float8_e4m3fn, (2, 32))  # transposed for the kernels
        assert (w.global_scale.dtype, w.global_scale.shape) == (jnp.float32, ())
    else:
        assert (w.data.dtype, w.data.shape, w.scale.dtype, w.scale.shape) == (jnp.float8_e4m3fn, (32, 32),
                                                                             jnp.float32, ())
    in_proj = read_linear(src, f"{PREFIX}.0.mixer.in_proj", spec, (100, 32), jnp.bfloat16)
    assert isinstance(in_proj, fmt) and in_proj.shape == (100, 32)
    head = read_linear(src, "lm_head", spec, (64, 32), jnp.float32)
    assert isinstance(head, jnp.ndarray) and head.dtype == jnp.float32 and head.shape == (64, 32)
    np.testing.assert_array_equal(np.asarray(head), dense["lm_head.weight"].astype(np.float32))
    rel = np.linalg.norm(np.asarray(dequantize(w)) - dense[m + ".weight"].astype(np.float32))
    assert rel / np.linalg.norm(dense[m + ".weight"].astype(np.float32)) < 0.15


def test_unquantised_checkpoint(tmp_path):
    dense = write_dense(tmp_path / "d")
    assert QuantSpec.from_dir(tmp_path / "d") is None
    w = read_linear(TensorSource(tmp_path / "d"), f"{PREFIX}.0.mixer.out_proj", None, (32, 32), jnp.bfloat16)
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w), dense[f"{PREFIX}.0.mixer.out_proj.weight"])


def test_quantiser_output_layout_and_configs(tmp_path):
    qdir, dense = quantized(tmp_path, "NVFP4")
    out = all_tensors(qdir)
    assert not any(n.endswith(".input_scale") for n in out)
    linears_ = set(linears())
    for name, arr in dense.items():  # non-linear tensors and excluded linears: byte-identical copies
        module = name.removesuffix(".weight")
        if module not in linears_ or module == "lm_head":
            assert out[name].dtype == arr.dtype and out[name].tobytes() == arr.tobytes(), name
    assert out[f"{PREFIX}.1.mixer.gate.weight"].dtype == np.float32
    cfg = json.loads((qdir / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == CONFIG
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "W4A16_NVFP4"  # no calibration: weight-only
    assert qc["config_groups"] == {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                           "group_size": 16}, "targets": ["Linear"]}}
    assert set(qc["ignore"]) == {"lm_head", "backbone.embeddings", *(f"{PREFIX}.{i}.mixer.conv1d" for i in (0, 2, 4, 6)),
                                 *(f"{PREFIX}.{i}.mixer.gate" for i in (1, 5))}
    hq = json.loads((qdir / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "W4A16_NVFP4" and hq["group_size"] == 16 and hq["exclude_modules"] == qc["ignore"]
    assert (qdir / "tokenizer.json").read_text() == "{}"


def test_nano_recipe_selects_exactly_the_official_modules(tmp_path):
    qdir, dense = quantized(tmp_path, "NANO_NVFP4")
    spec = QuantSpec.from_dir(qdir)
    assert spec.quant_algo == "W4A16_NVFP4"
    src = TensorSource(qdir)
    # pattern MEM*MEM-: attention at 3; Mamba 2 and 4 touch it, Mamba 0 and 6 do not
    dense_kept = {"lm_head", *(f"{PREFIX}.3.mixer.{p}_proj" for p in "qkvo"),
                  *(f"{PREFIX}.{i}.mixer.{p}" for i in (2, 4) for p in ("in_proj", "out_proj"))}
    for m in linears():
        want = None if m in dense_kept else "NVFP4"
        assert spec.algo_for(m) == want, m
        assert (src.dtype_of(m + ".weight") == "BF16") == (want is None), m
    assert f"{PREFIX}.3*" in spec.exclude  # the all-dense attention layer, summarised as ModelOpt does
    assert src.dtype_of(f"{PREFIX}.0.mixer.conv1d.weight") == "BF16"
    assert src.dtype_of(f"{PREFIX}.7.mixer.down_proj.weight") == "U8"
    fp8 = qz.plan_modules("NANO_FP8", linears(), tuple("mamba moe mamba attention mamba moe mamba mlp".split()))
    assert {m for m, a in fp8.items() if a is None} == dense_kept
    assert {a for a in fp8.values()} == {None, "FP8"}


def test_mixed_precision_round_trip(tmp_path):
    qdir, dense = quantized(tmp_path, "MIXED")
    spec = QuantSpec.from_dir(qdir)
    assert spec.quant_algo == "MIXED_PRECISION"
    layers = json.loads((qdir / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    for layer in (1, 5):  # one entry for a layer's routed experts, as ModelOpt writes it
        assert layers[f"{PREFIX}.{layer}.mixer.experts"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
        for j in range(4):
            assert spec.algo_for(f"{PREFIX}.{layer}.mixer.experts.{j}.down_proj") == "NVFP4"
    assert layers[f"{PREFIX}.0.mixer.in_proj"] == {"quant_algo": "FP8"}
    assert layers[f"{PREFIX}.1.mixer.shared_experts.down_proj"] == {"quant_algo": "FP8"}
    assert f"{PREFIX}.3.mixer.q_proj" not in layers and "lm_head" not in layers
    weights = read_all_linears(qdir, dense)
    kinds = {m: type(w).__name__ for m, w in weights.items()}
    assert kinds[f"{PREFIX}.5.mixer.experts.2.down_proj"] == "NVFP4Weight"
    assert kinds[f"{PREFIX}.6.mixer.out_proj"] == "FP8Weight"
    assert kinds[f"{PREFIX}.3.mixer.o_proj"] == "ArrayImpl" and kinds["lm_head"] == "ArrayImpl"
    done = dq.dequantize_checkpoint(qdir, tmp_path / "deq")
    assert set(done) == {m for m, k in kinds.items() if k != "ArrayImpl"}
    back = all_tensors(tmp_path / "deq")
    assert set(back) == set(dense)
    assert "quantization_config" not in json.loads((tmp_path / "deq" / "config.json").read_text())
    assert not (tmp_path / "deq" / "hf_quant_config.json").exists()
    for m, w in weights.items():
        if kinds[m] != "ArrayImpl":
            np.testing.assert_array_equal(f32_bits(back[m + ".weight"]), f32_bits(dequantize(w)), m)
            ref = dense[m + ".weight"].astype(np.float32)
            assert np.linalg.norm(back[m + ".weight"] - ref) / np.linalg.norm(ref) < 0.15, m
        else:
            assert back[m + ".weight"].tobytes() == dense[m + ".weight"].tobytes()


def test_sharded_output_and_bf16_dequant(tmp_path):
    write_dense(tmp_path / "dense")
    qz.quantize_checkpoint(tmp_path / "dense", tmp_path / "q", "FP8", max_shard_bytes=20_000)
    assert (tmp_path / "q" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "q").glob("model-*-of-*.safetensors"))) > 1
    dq.dequantize_checkpoint(tmp_path / "q", tmp_path / "deq", dtype="bfloat16")
    src = TensorSource(tmp_path / "deq")
    assert src.dtype_of(f"{PREFIX}.0.mixer.in_proj.weight") == "BF16"
    assert not any(n.endswith("weight_scale") for n in src.names())


def test_cli(tmp_path, capsys):
    write_dense(tmp_path / "dense")
    qz.main([str(tmp_path / "dense"), str(tmp_path / "q"), "--algo", "NVFP4", "--exclude", "lm_head", "*experts.0.*"])
    assert "NVFP4" in capsys.readouterr().out
    spec = QuantSpec.from_dir(tmp_path / "q")
    assert spec.algo_for(f"{PREFIX}.1.mixer.experts.0.up_proj") is None
    assert spec.algo_for(f"{PREFIX}.1.mixer.experts.1.up_proj") == "NVFP4"
    dq.main([str(tmp_path / "q"), str(tmp_path / "deq")])
    assert TensorSource(tmp_path / "deq").dtype_of("lm_head.weight") == "BF16"
    (tmp_path / "amax.json").write_text(json.dumps({m: 2.0 for m in linears()}))
    qz.main([str(tmp_path / "dense"), str(tmp_path / "c"), "--algo", "MAMBA_MOE_FP8_AGGRESSIVE",
             "--input-amax", str(tmp_path / "amax.json")])
    assert "input scales from" in capsys.readouterr().out
    src = TensorSource(tmp_path / "c")
    assert src.get(f"{PREFIX}.0.mixer.in_proj.input_scale") == np.float32(2.0) / np.float32(448)
    assert src.dtype_of(f"{PREFIX}.3.mixer.q_proj.weight") == "BF16"  # the aggressive recipe keeps attention dense
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="bad.json: not a JSON object"):
        qz.main([str(tmp_path / "dense"), str(tmp_path / "d"), "--algo", "FP8", "--input-amax", str(tmp_path / "bad.json")])


def test_input_and_kv_scales_are_accepted(tmp_path):
    qdir, dense = quantized(tmp_path, "FP8")
    attn = f"{PREFIX}.3.mixer"
    m = f"{PREFIX}.0.mixer.in_proj"

    def add(t):
        t[m + ".input_scale"] = np.array(0.5, np.float32)
        t[attn + ".k_proj.k_scale"] = np.array(0.25, np.float32)
        t[attn + ".v_proj.v_scale"] = np.array(0.125, np.float32)

    rewrite_tensors(qdir, add)
    src = TensorSource(qdir)
    assert isinstance(read_linear(src, m, QuantSpec.from_dir(qdir), (100, 32), jnp.bfloat16), FP8Weight)
    assert m + ".input_scale" in src.consumed
    k, v = read_kv_scales(src, attn)
    assert float(k) == 0.25 and float(v) == 0.125 and k.dtype == jnp.float32
    assert read_kv_scales(src, f"{PREFIX}.0.mixer") is None
    rewrite_tensors(qdir, lambda t: t.pop(attn + ".v_proj.v_scale"))
    with pytest.raises(CheckpointError, match=r"v_proj\.v_scale"):
        read_kv_scales(TensorSource(qdir), attn)


# ---- bad input -------------------------------------------------------------------------------------

def write_hf_quant(directory: Path, section: dict) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "hf_quant_config.json").write_text(json.dumps({"quantization": section}))


@pytest.mark.parametrize("section,culprit", [
    ({"quant_algo": "INT4_AWQ"}, "INT4_AWQ"),
    ({"quant_algo": "NVFP4", "group_size": 32}, "group_size 32"),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"backbone.layers.1.mixer.experts.0.up_proj":
                                                            {"quant_algo": "MXFP8"}}},
     r"backbone\.layers\.1\.mixer\.experts\.0\.up_proj.*MXFP8"),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"lm_head": {"quant_algo": "NVFP4", "group_size": 64}}},
     r"lm_head.*group_size 64"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}, "kv_cache_quant_algo 'NVFP4'"),
    ({"quant_algo": "FP8", "exclude_modules": "lm_head"}, "exclude"),
])
def test_bad_quant_config(tmp_path, section, culprit):
    write_hf_quant(tmp_path, section)
    with pytest.raises(CheckpointError, match=culprit):
        QuantSpec.from_dir(tmp_path)


def test_mixed_spec_lookup(tmp_path):
    write_hf_quant(tmp_path, {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
                              "exclude_modules": ["*in_proj"], "quantized_layers": {
                                  "backbone.layers.0.mixer.in_proj": {"quant_algo": "FP8"},
                                  "backbone.layers.1.mixer.experts.0.up_proj": {"quant_algo": "W4A16_NVFP4"}}})
    spec = QuantSpec.from_dir(tmp_path)
    assert spec.kv_cache_quant_algo == "FP8"
    assert spec.algo_for("backbone.layers.0.mixer.in_proj") == "FP8"  # the explicit entry beats the pattern
    assert spec.algo_for("backbone.layers.1.mixer.experts.0.up_proj") == "NVFP4"
    assert spec.algo_for("backbone.layers.1.mixer.experts.1.up_proj") is None  # unlisted: dense
    write_hf_quant(tmp_path, {"quant_algo": None, "kv_cache_quant_algo": None})
    assert QuantSpec.from_dir(tmp_path) is None


def test_config_json_spelling_and_disagreement(tmp_path):
    qc = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "ignore": ["lm_head", "*mixer.gate*"],
          "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    spec = QuantSpec.from_dir(tmp_path)
    assert (spec.quant_algo, spec.kv_cache_quant_algo) == ("W4A16_NVFP4", "FP8")
    assert spec.algo_for("lm_head") is None and spec.algo_for("backbone.layers.1.mixer.gate") is None
    write_hf_quant(tmp_path, {"quant_algo": "FP8"})
    with pytest.raises(CheckpointError, match="'FP8'.*'W4A16_NVFP4'"):
        QuantSpec.from_dir(tmp_path)
    qc.pop("quant_algo")  # compressed-tensors style config.json: hf_quant_config.json decides
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    assert QuantSpec.from_dir(tmp_path).quant_algo == "FP8"
    (tmp_path / "hf_quant_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(CheckpointError, match="gptq"):
        QuantSpec.from_dir(tmp_path)


def test_weight_scale_with_wrong_number_of_blocks(tmp_path):
    qdir, _ = quantized(tmp_path, "NVFP4")
    name = f"{PREFIX}.0.mixer.in_proj.weight_scale"
    rewrite_tensors(qdir, lambda t: t.__setitem__(name, t[name][:, :1].copy()))
    with pytest.raises(CheckpointError, match=rf"{name} in model\.safetensors.*shape \[100, 1\]"):
        read_linear(TensorSource(qdir), f"{PREFIX}.0.mixer.in_proj", QuantSpec.from_dir(qdir), (100, 32), jnp.bfloat16)


def test_fp8_weight_with_wrong_dtype(tmp_path):
    qdir, _ = quantized(tmp_path, "FP8")
    name = f"{PREFIX}.0.mixer.out_proj.weight"
    rewrite_tensors(qdir, lambda t: t.__setitem__(name, t[name].astype(np.float32).astype(ml_dtypes.float8_e5m2)))
    with pytest.raises(CheckpointError, match=rf"{name} in model\.safetensors: dtype F8_E5M2"):
        read_linear(TensorSource(qdir), f"{PREFIX}.0.mixer.out_proj", QuantSpec.from_dir(qdir), (32, 32), jnp.bfloat16)


def test_quantised_tensor_where_config_says_excluded(tmp_path):
    qdir, _ = quantized(tmp_path, "NVFP4")
    m = f"{PREFIX}.0.mixer.in_proj"
    edit_json(qdir / "hf_quant_config.json", lambda raw: raw["quantization"]["exclude_modules"].append(m))
    with pytest.raises(CheckpointError, match=rf"{m}\.weight in model\.safetensors: quantised tensor where the "
                                              "config says excluded"):
        read_linear(TensorSource(qdir), m, QuantSpec.from_dir(qdir), (100, 32), jnp.bfloat16)
    with pytest.raises(CheckpointError, match="quantised tensor where the config says excluded"):
        read_linear(TensorSource(qdir), m, None, (100, 32), jnp.bfloat16)


def test_module_that_should_be_quantised_stored_dense(tmp_path):
    qdir, _ = quantized(tmp_path, "NVFP4")
    edit_json(qdir / "hf_quant_config.json", lambda raw: raw["quantization"].__setitem__("exclude_modules", []))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight in model\.safetensors: stored dense \(BF16\)"):
        read_linear(TensorSource(qdir), "lm_head", QuantSpec.from_dir(qdir), (64, 32), jnp.bfloat16)


def test_missing_weight_scale_2(tmp_path):
    qdir, _ = quantized(tmp_path, "NVFP4")
    name = f"{PREFIX}.1.mixer.experts.2.down_proj.weight_scale_2"
    rewrite_tensors(qdir, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{name} is missing"):
        read_linear(TensorSource(qdir), name.removesuffix(".weight_scale_2"), QuantSpec.from_dir(qdir), (32, 32),
                    jnp.bfloat16)
    with pytest.raises(CheckpointError, match=rf"{name} is missing"):
        dq.dequantize_checkpoint(qdir, tmp_path / "deq")


def test_negative_or_nan_scale(tmp_path):
    qdir, _ = quantized(tmp_path, "FP8")
    name = f"{PREFIX}.0.mixer.out_proj.weight_scale"
    rewrite_tensors(qdir, lambda t: t.__setitem__(name, np.array(np.nan, np.float32)))
    with pytest.raises(CheckpointError, match=rf"{name} in model\.safetensors: scale nan"):
        read_linear(TensorSource(qdir), f"{PREFIX}.0.mixer.out_proj", QuantSpec.from_dir(qdir), (32, 32), jnp.bfloat16)


def test_quantiser_rejects_bad_input(tmp_path):
    write_dense(tmp_path / "odd", {**CONFIG, "moe_intermediate_size": 24})
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight in model\.safetensors: input dim 24 "
                                              "is not divisible by 16"):
        qz.quantize_checkpoint(tmp_path / "odd", tmp_path / "q1", "NVFP4")
    assert not (tmp_path / "q1").exists()  # checked before anything is written
    qz.quantize_checkpoint(tmp_path / "odd", tmp_path / "q2", "FP8")  # FP8 has no block constraint
    with pytest.raises(CheckpointError, match="already quantised"):
        qz.quantize_checkpoint(tmp_path / "q2", tmp_path / "q3", "FP8")
    with pytest.raises(CheckpointError, match="not empty"):
        qz.quantize_checkpoint(tmp_path / "odd", tmp_path / "q2", "FP8")
    with pytest.raises(ValueError, match="INT8"):
        qz.quantize_checkpoint(tmp_path / "odd", tmp_path / "q4", "INT8")
    name = "backbone.layers.0.mixer.in_proj.weight"
    rewrite_tensors(tmp_path / "odd", lambda t: t[name].__setitem__((0, 0), np.nan))
    with pytest.raises(CheckpointError, match=rf"{name}: non-finite"):
        qz.quantize_checkpoint(tmp_path / "odd", tmp_path / "q5", "FP8")


# ---- ModelOpt 0.47 naming, module-level keys, activation scales --------------------------------------

GARBLED = ".\x00backbone.pt_name_sentinel"  # what ModelOpt 0.47's model.->backbone. rename leaves behind


@pytest.mark.parametrize("raw,want", [
    ("lm_head" + GARBLED, "lm_head"),
    (f"{PREFIX}.0" + GARBLED + "*", f"{PREFIX}.0*"),
    (f"{PREFIX}.1.mixer" + GARBLED + ".*", f"{PREFIX}.1.mixer.*"),
    (f"{PREFIX}.2.mixer.experts.\x00modelopt_name_sentinel", f"{PREFIX}.2.mixer.experts"),  # marker intact
    ("backbone.embeddings", "backbone.embeddings"),
])
def test_normalise_module_name(raw, want):
    assert normalise_module_name(raw, "here") == want


@pytest.mark.parametrize("raw", ["lm_\x00head", "lm_head.\x00x", f"{PREFIX}.0" + GARBLED + GARBLED])
def test_nul_outside_the_marker_is_refused(raw):
    with pytest.raises(CheckpointError, match=r"here: module name .* NUL byte"):
        normalise_module_name(raw, "here")


def test_module_level_keys_cover_submodules_at_a_dot_boundary(tmp_path):
    write_hf_quant(tmp_path, {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        f"{PREFIX}.1.mixer.experts" + GARBLED: {"quant_algo": "NVFP4", "group_size": 16},
        f"{PREFIX}.1.mixer.experts.3.up_proj": {"quant_algo": "FP8"},  # the nearest entry decides
        f"{PREFIX}.2": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}})
    spec = QuantSpec.from_dir(tmp_path)
    assert spec.algo_for(f"{PREFIX}.1.mixer.experts.0.down_proj") == "NVFP4"
    assert spec.activation_algo_for(f"{PREFIX}.1.mixer.experts.0.down_proj") == "NVFP4"
    assert spec.algo_for(f"{PREFIX}.1.mixer.experts.3.up_proj") == "FP8"
    assert spec.algo_for(f"{PREFIX}.1.mixer.experts_up") is None  # a prefix, not a "." boundary
    assert spec.algo_for(f"{PREFIX}.2.mixer.in_proj") == "NVFP4"
    assert spec.activation_algo_for(f"{PREFIX}.2.mixer.in_proj") is None  # weight-only NVFP4
    assert spec.algo_for(f"{PREFIX}.20.mixer.in_proj") is None and spec.algo_for(f"{PREFIX}.1.mixer.gate") is None
    write_hf_quant(tmp_path, {"quant_algo": "FP8", "exclude_modules": [f"{PREFIX}.2" + GARBLED, "lm_head" + GARBLED,
                                                                       f"{PREFIX}.1*"]})
    spec = QuantSpec.from_dir(tmp_path)
    assert spec.exclude == (f"{PREFIX}.2", "lm_head", f"{PREFIX}.1*")
    assert spec.algo_for(f"{PREFIX}.2.mixer.in_proj") is None and spec.algo_for("lm_head") is None
    assert spec.algo_for(f"{PREFIX}.14.mixer.in_proj") is None  # fnmatch "*" crosses dots, as ModelOpt means it
    assert spec.algo_for(f"{PREFIX}.20.mixer.in_proj") == "FP8" == spec.activation_algo_for(f"{PREFIX}.0.mixer.in_proj")
    write_hf_quant(tmp_path, {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        f"{PREFIX}.2" + GARBLED: {"quant_algo": "FP8"}, f"{PREFIX}.2": {"quant_algo": "NVFP4"}}})
    with pytest.raises(CheckpointError, match=rf"names module {PREFIX}\.2 twice"):
        QuantSpec.from_dir(tmp_path)


def test_activation_scales_read_only_with_activation_quant(tmp_path):
    qdir, _ = quantized(tmp_path, "FP8")
    m, out_proj = f"{PREFIX}.0.mixer.in_proj", f"{PREFIX}.0.mixer.out_proj"
    rewrite_tensors(qdir, lambda t: t.update({m + ".input_scale": np.array(0.5, np.float32),
                                              out_proj + ".input_scale": np.array(0.0, np.float32)}))
    spec = QuantSpec.from_dir(qdir)
    assert read_linear(TensorSource(qdir), m, spec, (100, 32), jnp.bfloat16).input_scale is None
    w = read_linear(TensorSource(qdir), m, spec, (100, 32), jnp.bfloat16, activation_quant=True)
    assert float(w.input_scale) == 0.5 and w.to_hf()["input_scale"] == 0.5
    with pytest.raises(CheckpointError, match=rf"{out_proj}\.input_scale in model\.safetensors: scale 0\.0 is not "
                                              r"finite and > 0"):
        read_linear(TensorSource(qdir), out_proj, spec, (32, 32), jnp.bfloat16, activation_quant=True)
    up = f"{PREFIX}.7.mixer.up_proj"
    with pytest.raises(CheckpointError, match=rf"{up}\.input_scale is missing .* quantises the activations of {up} "
                                              r"\(FP8\); load with activation_quant=False"):
        read_linear(TensorSource(qdir), up, spec, (48, 32), jnp.bfloat16, activation_quant=True)
    nvfp4, _ = quantized(tmp_path / "w4", "NVFP4")  # uncalibrated: W4A16_NVFP4, weight-only whatever is asked
    w = read_linear(TensorSource(nvfp4), up, QuantSpec.from_dir(nvfp4), (48, 32), jnp.bfloat16, activation_quant=True)
    assert isinstance(w, NVFP4Weight) and w.input_scale is None


def test_experts_in_two_formats_are_refused(tmp_path):
    """On one device (experts stacked as read) and on a mesh (experts read per block when placed)."""
    qdir, _ = quantized(tmp_path, "NVFP4", exclude=["lm_head", "*.1.mixer.experts.2.*"])
    one_device = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("expert", "tensor"))
    for mesh in (None, one_device):
        with pytest.raises(CheckpointError, match=rf"{PREFIX}\.1\.mixer\.experts\.2\.up_proj: stored as a dense "
                                                  r"array but .*experts\.0\.up_proj as "
                                                  r"NVFP4Weight \(input_scale used: False\)"):
            nemoh.load(qdir, dtype=jnp.float32, mesh=mesh)


def test_calibrated_quantiser_writes_input_scales_and_shares_qkv_global_scale(tmp_path):
    dense = write_dense(tmp_path / "dense")
    plan = qz.plan_modules("NVFP4", linears(), NemotronHConfig.from_dict(CONFIG).layer_kinds)
    amax = {m: 1.0 + i / 8 for i, m in enumerate(linears())}
    qz.quantize_checkpoint(tmp_path / "dense", tmp_path / "q", "NVFP4", input_amax=amax)
    out, attn = all_tensors(tmp_path / "q"), f"{PREFIX}.3.mixer"
    qkv = [f"{attn}.{p}_proj" for p in "qkv"]
    shared = max(qz.nvfp4_global_scale(dense[m + ".weight"]) for m in qkv)
    for m in qkv:  # one weight_scale_2 (the largest) and one input amax (the largest) for q/k/v
        assert out[m + ".weight_scale_2"] == shared
        assert out[m + ".input_scale"] == np.float32(max(amax[q] for q in qkv)) / np.float32(2688)
        packed, block, _ = qz.nvfp4_quantize(dense[m + ".weight"], shared)
        assert out[m + ".weight"].tobytes() == packed.tobytes() and out[m + ".weight_scale"].tobytes() == block.tobytes()
    assert out[f"{attn}.o_proj.weight_scale_2"] == qz.nvfp4_global_scale(dense[f"{attn}.o_proj.weight"])
    m = f"{PREFIX}.0.mixer.in_proj"
    assert out[m + ".input_scale"] == np.float32(amax[m]) / np.float32(6 * 448)
    assert not any(k.startswith("lm_head.") and k != "lm_head.weight" for k in out)
    assert json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    qz.quantize_checkpoint(tmp_path / "dense", tmp_path / "f", "FP8", input_amax=amax)
    assert all_tensors(tmp_path / "f")[m + ".input_scale"] == np.float32(amax[m]) / np.float32(448)
    missing = {k: v for k, v in amax.items() if k != m}
    with pytest.raises(CheckpointError, match=rf"input_amax: module {m} needs a finite amax > 0"):
        qz.quantize_checkpoint(tmp_path / "dense", tmp_path / "g", "FP8", input_amax=missing)
    assert plan["lm_head"] is None


def test_exclude_summary_is_modelopts():
    """Dense modules as ModelOpt summarises them: the shortest "prefix*" matching no quantised module, else
    "prefix.*", else the name itself."""
    quantized_ = [f"{PREFIX}.10.mixer.in_proj", f"{PREFIX}.2.mixer.up_proj", f"{PREFIX}.0.mixer.out_proj"]
    excluded = ["lm_head", "backbone.embeddings", f"{PREFIX}.0.mixer.in_proj", f"{PREFIX}.0.mixer.conv1d",
                f"{PREFIX}.1.mixer.gate", f"{PREFIX}.1.mixer.experts", f"{PREFIX}.2.mixer.down_proj",
                f"{PREFIX}.3.mixer.q_proj"]
    assert qz.summarize_exclude(excluded, quantized_) == [
        "backbone.embeddings", f"{PREFIX}.0.mixer.conv1d", f"{PREFIX}.0.mixer.in_proj",
        f"{PREFIX}.1.*",  # "backbone.layers.1*" would match the quantised layer 10
        f"{PREFIX}.2.mixer.down_proj", f"{PREFIX}.3*", "lm_head"]
