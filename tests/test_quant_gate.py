"""Quantised checkpoints through the token gate: nemoh runs the packed NVFP4 / FP8 / mixed weights,
transformers runs the numpy-dequantised copy of the same weights, both in fp32 activations."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import nemoh
from nemoh import oracle
from nemoh.gate import compare, default_prompts
from nemoh.io.dequantize import dequantize_checkpoint
from nemoh.io.quantize import quantize_checkpoint
from pallas_kernels import FP8Weight, NVFP4Weight

from oracle_configs import CONFIGS

ALGOS = ("NVFP4", "FP8", "MIXED", "NANO_NVFP4")
# every layer kind, attention next to Mamba (so the Nano recipe keeps some dense); every linear's input
# width a multiple of the NVFP4 block of 16
QUANT_CONFIG = {**CONFIGS["all_kinds"], "moe_shared_expert_intermediate_size": 32, "hybrid_override_pattern": "M*EM-EME"}


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    """algo -> (quantised dir, dequantised dir, prompts, oracle tokens); one oracle call for all."""
    root = tmp_path_factory.mktemp("quant_gate")
    (src,) = oracle.make_checkpoints([dict(config=QUANT_CONFIG, out_dir=str(root / "dense"), seed=5,
                                           dtype="float32", layout_spelling="pattern")])
    cfg = nemoh.NemotronHConfig.from_json_file(src / "config.json")
    prompts = default_prompts(cfg, [2, 2 * cfg.chunk_size + 5, 11], seed=3)
    dirs = {}
    for algo in ALGOS:
        q, d = root / f"{algo}-q", root / f"{algo}-dq"
        quantize_checkpoint(src, q, algo)
        dequantize_checkpoint(q, d, dtype="float32")
        dirs[algo] = (q, d)
    ref = oracle.greedy([dict(model_dir=str(d), prompts=prompts, max_new_tokens=24,
                              stop_token_ids=list(cfg.eos_token_ids), dtype="float32") for _, d in dirs.values()])
    return {algo: (*dirs[algo], prompts, [r["tokens"] for r in rows]) for algo, rows in zip(ALGOS, ref)}


@pytest.mark.parametrize("algo", ALGOS)
def test_quantised_gate_strict(quantised, algo):
    qdir, _, prompts, ref = quantised[algo]
    params = nemoh.load(qdir, dtype=jnp.float32)
    kinds = {type(w).__name__ for layer in params.layers for w in vars(layer).values()
             if isinstance(w, (FP8Weight, NVFP4Weight))}
    assert kinds, f"{algo}: no quantised weight was loaded"
    result = compare(nemoh.generate(params, prompts, max_new_tokens=24), ref)
    print(f"[{algo}] {result.line()}")
    assert result.strict, result.line()
    assert result.total >= 24 * len(prompts) // 2, f"the oracle stopped early: {result.line()}"

