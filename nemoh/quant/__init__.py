"""Quantised weight types (pytrees), their reference dequantisation, and the one linear dispatch."""

from nemoh.quant.types import FP8Weight, NVFP4Weight, Weight, dequantize, weight_shape
from nemoh.quant.linear import linear

__all__ = ["FP8Weight", "NVFP4Weight", "Weight", "dequantize", "weight_shape", "linear"]
