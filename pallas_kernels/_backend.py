"""Which implementation runs (impl=...), and the interpreter parameters for CPU runs.

impl: "pallas" (the Mosaic GPU kernel, compiled for the GPU), "interpret" (the same kernel body run
on CPU by the Mosaic GPU interpreter, for CI), "xla" (the jnp reference). None picks "pallas" on a GPU
backend and "xla" elsewhere, and "xla" in programs that XLA partitions over a device mesh.
"""

from __future__ import annotations

import contextlib
import functools

import jax
from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
from jax.sharding import AxisType

IMPLS = ("pallas", "interpret", "xla")
DEFAULT_NUM_SMS = 132  # H100 / H200 SXM: used off the GPU (interpret mode) or where a GPU reports no core count


_default_override: list[str] = []


@contextlib.contextmanager
def default_impl(impl: str):
    """Within this block, ops called with impl=None use `impl` (e.g. "xla" to trace a reference).
    It acts when a function is traced: jit-compiled callers already traced keep their impl."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _default_override.append(impl)
    try:
        yield
    finally:
        _default_override.pop()


def default_override() -> str | None:
    """The innermost default_impl's impl, None outside any."""
    return _default_override[-1] if _default_override else None


def compiler_partitioned() -> bool:
    """Whether ops are being traced into a program that XLA splits over several devices itself (an
    abstract mesh with non-manual axes of size > 1, as nemoh's sharded programs trace under). A Mosaic
    GPU kernel is one custom call that XLA cannot split, so there impl=None means "xla"; inside shard_map
    (manual axes: per-device operands) the kernels run."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(size > 1 and kind != AxisType.Manual for size, kind in zip(mesh.axis_sizes, mesh.axis_types))


def resolve_impl(impl: str | None) -> str:
    """Validate `impl`; None means the innermost `default_impl`, else "pallas" on GPU (outside programs
    XLA partitions, see compiler_partitioned) and "xla" otherwise."""
    if impl is None:
        override = default_override()
        if override is not None:
            return override
        return "pallas" if jax.default_backend() == "gpu" and not compiler_partitioned() else "xla"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def interpret_params(impl: str):
    """The `interpret=` argument of plgpu.kernel for a resolved kernel impl."""
    return InterpretGPUParams(uninitialized_memory="nan") if impl == "interpret" else None


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the default device (split-K targets a few CTAs per SM)."""
    device = jax.devices()[0]
    cores = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return cores or DEFAULT_NUM_SMS
