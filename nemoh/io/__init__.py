"""Checkpoint I/O: safetensors reading, the HF key map, ModelOpt quantised formats, the quantiser."""
