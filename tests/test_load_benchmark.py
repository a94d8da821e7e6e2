"""benchmarks/load.py's checkpoint writer: every tensor of the layout table, in the ModelOpt layout of the
recipe (NVFP4 codes, block scales, input scales; dense where the recipe keeps it), loadable by nemoh."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

import nemoh
from benchmarks.load import write_checkpoint
from nemoh.io.layout import hf_layout
from nemoh.io.quantize import plan_modules
from nemoh.io.tensor_source import TensorSource
from oracle_configs import QUANTISABLE_WIDTHS
from pallas_kernels import NVFP4Weight

CONFIG = {**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "ME*M"}


def test_written_checkpoint_is_modelopt_layout_and_loads(tmp_path):
    write_checkpoint(CONFIG, "NANO_NVFP4", tmp_path / "ck")
    cfg = nemoh.NemotronHConfig.from_dict(CONFIG)
    src = TensorSource(tmp_path / "ck")
    quant = json.loads((tmp_path / "ck" / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and "lm_head" in quant["exclude_modules"]
    projections = [spec for spec in hf_layout(cfg) if spec.projection]
    plan = plan_modules("NANO_NVFP4", [spec.name for spec in projections], cfg.layer_kinds)
    for spec in hf_layout(cfg):
        if not spec.projection:
            assert src.shape_of(spec.name) == spec.shape
        elif plan[spec.name] == "NVFP4":  # packed codes, block scales, global and input scales
            assert src.dtype_of(spec.name + ".weight") == "U8", spec.name
            assert src.shape_of(spec.name + ".weight") == (spec.shape[0], spec.shape[1] // 2), spec.name
            assert src.shape_of(spec.name + ".weight_scale") == (spec.shape[0], spec.shape[1] // 16), spec.name
            assert src.has(spec.name + ".weight_scale_2") and src.has(spec.name + ".input_scale"), spec.name
        else:  # kept dense by the recipe (attention, the Mamba layer beside it, lm_head)
            assert plan[spec.name] is None and src.dtype_of(spec.name + ".weight") == "BF16", spec.name
            assert src.shape_of(spec.name + ".weight") == spec.shape, spec.name
    assert {plan[spec.name] for spec in projections} == {"NVFP4", None}  # both branches ran
    params = nemoh.load(tmp_path / "ck", dtype=jnp.bfloat16)
    assert isinstance(params.layers[1].experts_up, NVFP4Weight)
    logits = nemoh.forward(params, [[1, 2, 3]])
    assert np.isfinite(np.asarray(logits)).all()
