"""Pallas (Mosaic GPU) kernels for quantised NemotronH inference on Hopper, and the weight formats
they read. A leaf package: it imports jax and numpy only.

Ops (each takes impl="pallas" (GPU kernel), "interpret" (same kernel body on CPU, for CI) or "xla"
(jnp reference); None picks "pallas" on a GPU backend, "xla" elsewhere):
  linear(x, w)       y = x @ W^T for a dense, FP8Weight or NVFP4Weight weight
  moe_experts(...)   routed experts of an MoE layer, reading only the selected experts' weights
Formats: FP8Weight, NVFP4Weight (pallas_kernels.formats); `dequantize` is their reference. A weight with
an input_scale quantises the op's input first (FP8 W8A8, NVFP4 emulated W4A4); without, weight-only.
All ops run one Mosaic GPU kernel (plgpu.kernel, _wgemm.py); no Triton lowering is used.
"""

from pallas_kernels._backend import default_impl
from pallas_kernels._blocked import trace_settings
from pallas_kernels.formats import FP8Weight, NVFP4Weight, Weight, dequantize, is_quantized
from pallas_kernels.linear import linear
from pallas_kernels.moe import moe_experts

__all__ = ["default_impl", "trace_settings", "FP8Weight", "NVFP4Weight", "Weight", "dequantize", "is_quantized",
           "linear", "moe_experts"]
