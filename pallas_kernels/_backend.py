"""Which implementation runs (impl=...), and the one import of Mosaic GPU's private interpret params.

impl: "pallas" (the Mosaic GPU kernel, compiled for the GPU), "interpret" (the same kernel body run
on CPU by the Mosaic GPU interpreter, for CI), "xla" (the jnp reference). None picks "pallas" on a GPU
backend and "xla" elsewhere.
"""

from __future__ import annotations

import jax

# Private module (jax 0.11.2): the only place this package touches it.
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

IMPLS = ("pallas", "interpret", "xla")


def resolve_impl(impl: str | None) -> str:
    """Validate `impl`, defaulting to "pallas" on GPU and "xla" otherwise."""
    if impl is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def interpret_params(impl: str):
    """The `interpret=` argument of plgpu.kernel for a resolved kernel impl."""
    return InterpretGPUParams(uninitialized_memory="nan") if impl == "interpret" else None
