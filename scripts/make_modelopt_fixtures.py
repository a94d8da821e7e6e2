"""Make the NVIDIA ModelOpt export fixtures under tests/data/modelopt/ (run once; CI only reads them).

    /path/to/modelopt-venv/bin/python scripts/make_modelopt_fixtures.py [--out tests/data/modelopt]

Needs Python 3.11 with torch 2.13 (CPU), transformers 5.24.0 and nvidia-modelopt 0.47.0 (installed with
--no-deps plus its listed requirements, so pip does not pull a CUDA torch); never imports nemoh or jax.
Deterministic: fixed seeds for the weights, the calibration batches and the prompts.

What it writes:
  dense-fp32/, dense-bf16/   the tiny random NemotronH (every layer kind) the exports were made from, saved
                             with transformers' save_pretrained (the bf16 one is the fp32 weights rounded;
                             router weights stay fp32)
  <recipe>-<dtype>/          for each RECIPES entry and dtype:
      config.json, hf_quant_config.json, model.safetensors, generation_config.json
                             exactly as `export_hf_checkpoint` wrote them (not edited)
      input_amax.json        {module: amax} of every calibrated activation quantiser, HF module names
                             (each routed expert listed with its layer's shared value)
      reference.npz          tokens_w / logits_w, and where the recipe quantises activations
                             tokens_wa / logits_wa: int32 [2, 24] sequences (prompt + greedy continuation)
                             and float32 [2, 24, V] logits of those sequences
      reference.json         what the reference is, prompt lengths, versions, fake-quant diagnostics

The references are ModelOpt's own quantised model (mtq.quantize, calibrated here), in float32 whatever the
export's dtype, with:
  weights   every quantised weight replaced by the export's tensors dequantised with ModelOpt's
            NVFP4QTensor / FP8QTensor.dequantize, weight quantisers off, so the reference computes with
            exactly the weights the checkpoint stores;
  "w"       (weight-only, what Hopper stacks run): every activation quantiser off;
  "wa"      (weights + activations): the input quantisers on as calibrated, i.e. FP8 inputs through
            ModelOpt's fp8 fake quant, NVFP4 inputs through its dynamic block fake quant. That op needs CUDA
            in ModelOpt 0.47 ("amax must be a CUDA tensor for dynamic block quantization"), so here it runs
            ModelOpt's pure-torch NVFP4QTensor.quantize / dequantize with global scale amax / (6 * 448),
            the arithmetic of its GPU kernel. KV-cache quantisers stay off (nemoh keeps the KV cache in
            the model dtype).
Greedy continuation: argmax of repeated full forwards without a cache, each reference on its own.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = {  # every layer kind (M, *, E, -), attention next to Mamba, all input widths multiples of 16
    "vocab_size": 128, "hidden_size": 32, "hybrid_override_pattern": "M*EM-EME",
    "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2, "conv_kernel": 4,
    "chunk_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
    "use_conv_bias": True, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 3,
}
SEED = 7
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CALIB_BATCHES, CALIB_LEN = 4, 24
PROMPT_LENS, TOTAL_LEN = (5, 9), 24
NVFP4_BLOCK = 16


def _hf_worker():
    """nemoh/oracle/hf_worker.py (standalone: torch + transformers only) loaded by path."""
    spec = importlib.util.spec_from_file_location("hf_worker", REPO / "nemoh" / "oracle" / "hf_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipes(mtq) -> dict[str, dict]:
    """Fixture name -> ModelOpt quantisation config."""
    nvfp4 = {"num_bits": (2, 1), "block_sizes": {-1: NVFP4_BLOCK, "type": "dynamic", "scale_bits": (4, 3)}}
    mixed = copy.deepcopy(mtq.FP8_DEFAULT_CFG)  # routed experts NVFP4, other linears FP8, attention dense
    mixed["quant_cfg"] += [{"quantizer_name": "*mixer.experts*weight_quantizer*", "cfg": nvfp4},
                           {"quantizer_name": "*mixer.experts*input_quantizer*", "cfg": nvfp4},
                           {"quantizer_name": "*mixer.[qkvo]_proj*", "enable": False}]
    kv = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    kv["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    named = {"nvfp4": "NVFP4_DEFAULT", "fp8": "FP8_DEFAULT", **{n.lower(): n for n in (
        "W4A16_NVFP4", "MAMBA_MOE_NVFP4_CONSERVATIVE", "MAMBA_MOE_NVFP4_AGGRESSIVE", "MAMBA_MOE_FP8_CONSERVATIVE",
        "MAMBA_MOE_FP8_AGGRESSIVE")}}
    named = {name: copy.deepcopy(getattr(mtq, f"{cfg}_CFG")) for name, cfg in named.items()}
    return {**named, "mixed_precision": mixed, "nvfp4_fp8_kv": kv}


def cpu_dynamic_block_quant(inputs, block_size, amax, bias, num_bits, scale_bits, *rest):
    """ModelOpt's NVFP4 dynamic block fake quant, via its pure-torch NVFP4QTensor (the op needs CUDA)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    if tuple(num_bits) != (2, 1) or tuple(scale_bits) != (4, 3) or bias is not None:
        raise NotImplementedError(f"CPU fallback covers NVFP4 only, got {num_bits}, {scale_bits}")
    global_scale = amax.float() / (6.0 * 448.0)
    q, scale, scale_2 = NVFP4QTensor.quantize(inputs.contiguous(), block_size, weights_scaling_factor_2=global_scale)
    return q.dequantize(dtype=inputs.dtype, scale=scale, double_scale=scale_2, block_sizes={-1: block_size})


def hub_name(name: str) -> str:
    """In-memory module name (model.layers...) -> checkpoint name (backbone.layers...)."""
    return "backbone." + name.removeprefix("model.") if name.startswith("model.") else name


def calibration_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(4, CONFIG["vocab_size"], (1, CALIB_LEN), generator=g) for _ in range(CALIB_BATCHES)]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED + 2)
    return [torch.randint(4, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]


def input_amax(model) -> dict[str, float]:
    """{HF module: calibrated input amax} of every enabled input quantiser (fused experts per expert)."""
    out = {}
    for name, module in model.named_modules():
        q = getattr(module, "input_quantizer", None)
        if q is not None and q.is_enabled and q.amax is not None:
            out[hub_name(name)] = float(q.amax.float())
        for proj in ("up_proj", "down_proj"):
            q = getattr(module, f"{proj}_input_quantizer", None)
            if q is not None and q.is_enabled and q.amax is not None:
                for j in range(module.num_experts):
                    out[f"{hub_name(name)}.{j}.{proj}"] = float(q.amax.float())
    return dict(sorted(out.items()))


def exported_weights(export_dir: Path) -> dict[str, torch.Tensor]:
    """{HF module: float32 weight} of every quantised module of an export, dequantised by ModelOpt."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
    from safetensors.torch import load_file

    t = load_file(str(export_dir / "model.safetensors"))
    out = {}
    for name, w in t.items():
        if not name.endswith(".weight") or name.removesuffix(".weight") + ".weight_scale" not in t:
            continue
        m = name.removesuffix(".weight")
        if w.dtype == torch.uint8:
            shape = (w.shape[0], 2 * w.shape[1])
            out[m] = NVFP4QTensor(shape, torch.float32, w).dequantize(
                dtype=torch.float32, scale=t[m + ".weight_scale"], double_scale=t[m + ".weight_scale_2"],
                block_sizes={-1: NVFP4_BLOCK})
        else:
            out[m] = FP8QTensor(tuple(w.shape), torch.float32, w).dequantize(
                dtype=torch.float32, scale=t[m + ".weight_scale"])
    return out


def set_weight(model, module: str, value: torch.Tensor) -> None:
    """Write a checkpoint module's dense weight into the model (routed experts are slices of a 3-D param)."""
    inner = "model." + module.removeprefix("backbone.")
    parts = inner.split(".")
    with torch.no_grad():
        if parts[-3] == "experts":
            getattr(model.get_submodule(".".join(parts[:-2])), parts[-1])[int(parts[-2])].copy_(value)
        else:
            model.get_submodule(inner).weight.copy_(value)


def fake_quant_weight_diff(model, weights: dict[str, torch.Tensor]) -> dict:
    """How ModelOpt's own weight fake quant (float32) differs from the exported weights, per element."""
    differing, max_abs = 0, 0.0
    for module, w in weights.items():
        inner = "model." + module.removeprefix("backbone.")
        parts = inner.split(".")
        if parts[-3] == "experts":
            owner = model.get_submodule(".".join(parts[:-2]))
            j = int(parts[-2])
            src = getattr(owner, parts[-1])[j].float()
            fq = getattr(owner, f"{parts[-1]}_weight_quantizers")[j](src)
        else:
            lin = model.get_submodule(inner)
            fq = lin.weight_quantizer(lin.weight.float())
        diff = (fq.float() - w).abs()
        differing += int((diff > 0).sum())
        max_abs = max(max_abs, float(diff.max()))
    return {"elements_differing": differing, "max_abs_diff": max_abs}


def reference_model(quantised, weights: dict[str, torch.Tensor], activations: bool):
    """float32 copy of the quantised model computing with the exported weights; input quantisers on or off."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    model = copy.deepcopy(quantised).float()
    for module, w in weights.items():
        set_weight(model, module, w)
    for name, q in model.named_modules():
        if isinstance(q, TensorQuantizer):
            keep = activations and name.endswith("input_quantizer")
            if not keep:
                q.disable()
    return model.eval()


def greedy(model, hw, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    while len(ids) < TOTAL_LEN:
        ids.append(int(torch.argmax(hw.forward_logits(model, ids)[-1])))
    return ids


def references(model, hw) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [2, TOTAL_LEN], logits float32 [2, TOTAL_LEN, V]) of greedy continuations."""
    watch = hw.DtWatch(model)
    seqs = [greedy(model, hw, p) for p in prompts()]
    logits = np.stack([hw.forward_logits(model, s).numpy() for s in seqs])
    watch.check("reference model")
    return np.asarray(seqs, np.int32), logits.astype(np.float32)


def make_fixture(name: str, qcfg: dict, dense: Path, dtype: str, out: Path, hw, versions: dict) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM.from_pretrained(dense, dtype=DTYPES[dtype], attn_implementation="eager").eval()
    calib = calibration_batches()
    with torch.no_grad():
        model = mtq.quantize(model, qcfg, lambda m: [m(input_ids=x, use_cache=False) for x in calib])
    quantised = copy.deepcopy(model)  # export rewrites modules in place
    amax = input_amax(quantised)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(model, export_dir=tmp)
        target = out / f"{name}-{dtype}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tmp, target)
    weights = exported_weights(target)
    record = {
        "recipe": name, "dtype": dtype, "dense_source": dense.name, "versions": versions,
        "prompt_lengths": list(PROMPT_LENS), "calibration": f"{CALIB_BATCHES} random sequences of {CALIB_LEN}",
        "fake_quant_weights_vs_export": fake_quant_weight_diff(quantised.float(), weights),
        "references": {"w": "ModelOpt model, exported weights, activation quantisers off (float32)"},
    }
    arrays = {}
    with torch.no_grad():
        arrays["tokens_w"], arrays["logits_w"] = references(reference_model(quantised, weights, False), hw)
        if amax:
            record["references"]["wa"] = ("ModelOpt model, exported weights, input quantisers on as calibrated "
                                          "(NVFP4 via NVFP4QTensor on CPU), KV-cache quantisers off (float32)")
            arrays["tokens_wa"], arrays["logits_wa"] = references(reference_model(quantised, weights, True), hw)
    (target / "input_amax.json").write_text(json.dumps(amax, indent=1) + "\n")
    (target / "reference.json").write_text(json.dumps(record, indent=1) + "\n")
    np.savez_compressed(target / "reference.npz", **arrays)
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"{target.name}: {size / 1024:.0f} KiB, fake quant vs export {record['fake_quant_weights_vs_export']}",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "tests" / "data" / "modelopt"))
    parser.add_argument("--only", nargs="*", help="fixture recipes to (re)make (default: all)")
    args = parser.parse_args(argv)
    import modelopt
    import modelopt.torch.quantization as mtq
    import modelopt.torch.quantization.nn.modules.tensor_quantizer as tq
    import transformers

    torch.set_num_threads(2)
    tq.dynamic_block_quant = cpu_dynamic_block_quant
    hw = _hf_worker()
    out = Path(args.out)
    versions = {"modelopt": modelopt.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    dense = {}
    for dtype in DTYPES:
        dense[dtype] = out / f"dense-{dtype}"
        shutil.rmtree(dense[dtype], ignore_errors=True)
        hw.make({"config": CONFIG, "out_dir": str(dense[dtype]), "seed": SEED,
                 "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype], "layout_spelling": "pattern"})
    for name, qcfg in recipes(mtq).items():
        if args.only and name not in args.only:
            continue
        for dtype in DTYPES:
            make_fixture(name, copy.deepcopy(qcfg), dense[dtype], dtype, out, hw, versions)


if __name__ == "__main__":
    sys.exit(main())
