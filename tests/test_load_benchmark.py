"""benchmarks/load.py's checkpoint writer: every tensor of the layout table, in the ModelOpt layout of the
recipe (NVFP4 codes, block scales, input scales; dense where the recipe keeps it), loadable by nemoh."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

import nemoh
from benchmarks.load import write_checkpoint
from nemoh.io.layout import hf_layout
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
    for spec in hf_layout(cfg):
        if not spec.projection:
            assert src.shape_of(spec.name) == spec.shape
        elif spec.name == "backbone.layers.1.mixer.experts.0.up_proj":  # routed expert: NVFP4 + input_scale
            assert src.dtype_of(spec.name + ".weight") == "U8" and src.has(spec.name + ".input_scale")
            assert src.shape_of(spec.name + ".weight_scale") == (spec.shape[0], spec.shape[1] // 16)
        elif spec.name == "backbone.layers.2.mixer.q_proj":  # attention stays bf16 in the Nano layout
            assert src.dtype_of(spec.name + ".weight") == "BF16"
    params = nemoh.load(tmp_path / "ck", dtype=jnp.bfloat16)
    assert isinstance(params.layers[1].experts_up, NVFP4Weight)
    logits = nemoh.forward(params, [[1, 2, 3]])
    assert np.isfinite(np.asarray(logits)).all()
