"""Pallas (Mosaic GPU) kernels for quantised NemotronH inference on Hopper.

nvfp4_matmul (W4A16), fp8_matmul (W8A16) and moe_experts (routed experts reading only the selected
experts' weights). Each takes impl="pallas" (GPU kernel), "interpret" (same kernel body on CPU, for
CI) or "xla" (jnp reference); the default is "pallas" on a GPU backend, "xla" elsewhere.
Lowering: all three run one Mosaic GPU kernel (plgpu.kernel, _wgemm.py); no Triton lowering is used.
"""

from pallas_kernels.matmul import fp8_matmul, nvfp4_matmul
from pallas_kernels.moe import moe_experts

__all__ = ["nvfp4_matmul", "fp8_matmul", "moe_experts"]
