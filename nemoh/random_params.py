"""random_params: a NemotronH model with random weights, built directly on the device.

For benchmarks and tests at any size without a checkpoint: the same ModelParams the loader builds
(`nemoh.io.loader.build_params` asks this module's reader instead of a safetensors file), in any of
the quantiser's layouts, so the weights are packed exactly as a loaded ModelOpt checkpoint's are.

Values are drawn so that activations stay O(1) through depth: projections have standard deviation
1/sqrt(in), Mamba dt lands in [1e-3, 1e-1], A in [-16, -1], norms are 1. Each tensor's values depend only
on (seed, tensor name), never on the order of construction.

Every layout holds the same projection values up to its format's rounding: uniformly random e2m1 codes
times random block scales (exact in NVFP4), dequantised for dense projections and rounded to e4m3 for
FP8. So the formats' benchmarks time one net. The law matters beyond that: a wide random net whose
projections are drawn normal lets a batch's rows drift to alike hidden states that select the same few
experts (CPU, hidden 2,688, 14 layers, 16 experts, 8 greedy rows: 2-3 distinct tokens and 10.9 distinct
experts a MoE layer and step after 27 steps, against 15.6 for uniform routing), so its batch steps read
a fraction of the expert bytes served text makes them read; with this law the rows kept 8 tokens and
15.2 experts.
"""

from __future__ import annotations

import zlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from nemoh.config import NemotronHConfig
from nemoh.errors import RequestError
from nemoh.io.deferred import Drawn, Whole, place
from nemoh.io.loader import build_params
from nemoh.io.quantize import ALGOS, plan_modules
from nemoh.model import ModelParams
from nemoh.sharding.params import check_params
from nemoh.sharding.placement import make_placement
from pallas_kernels.formats import E2M1_VALUES, NVFP4_BLOCK, FP8Weight, NVFP4Weight

LAYOUTS = ("dense",) + ALGOS  # dense, or a recipe of nemoh.io.quantize
_E2M1_STD = float(np.sqrt(np.mean(E2M1_VALUES**2)))  # std of a uniformly random e2m1 code
_BLOCK_SCALE_RANGE = (64.0, 448.0)  # random NVFP4 block scales, in fp8 e4m3 units
_FP8_SPREAD = 64.0  # FP8 codes have std _FP8_SPREAD: the largest value, 3.3 std, is a code of ~210 (< 448)


class _RandomReader:
    """The loader's reader interface (has, kv_scales, vector, linear, stacked_linear), drawing values;
    deferred=True: Deferred leaves (nemoh.io.deferred), projections drawn straight into their shardings
    and vectors drawn whole, then split."""

    def __init__(self, cfg: NemotronHConfig, layout: str, dtype, seed: int, deferred: bool = False):
        self.cfg, self.layout, self.dtype, self.deferred, self.seed = cfg, layout, jnp.dtype(dtype), deferred, seed

    def _key(self, name: str) -> jax.Array:
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), zlib.crc32(name.encode()))

    def _format(self, module: str) -> str | None:
        if self.layout == "dense":
            return None
        return plan_modules(self.layout, [module], self.cfg.layer_kinds)[module]

    def has(self, name: str) -> bool:
        return False

    def kv_scales(self, module_prefix: str) -> None:
        return None

    def vector(self, name: str, shape: tuple[int, ...], dtype=None):
        leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]  # embeddings, norm, conv1d, gate, A_log, ...
        args = (leaf, tuple(shape), jnp.dtype(dtype or self.dtype))
        if self.deferred:  # keys too are made only when placed
            return Whole(jax.ShapeDtypeStruct(*args[1:]), lambda: _draw_vector(self._key(name), *args)).tree()
        return _draw_vector(self._key(name), *args)

    def linear(self, module: str, out_dim: int, in_dim: int):
        return self._weight(module, self._format(module), (), out_dim, in_dim)

    def stacked_linear(self, modules: list[str], out_dim: int, in_dim: int):
        formats = {self._format(m) for m in modules}
        if len(formats) != 1:
            raise ValueError(f"experts {modules[0]}..: layout {self.layout} mixes formats {sorted(map(str, formats))}")
        return self._weight(modules[0].rsplit(".", 2)[0] + ".stacked", formats.pop(), (len(modules),),
                            out_dim, in_dim)

    def _weight(self, module: str, fmt: str | None, lead: tuple[int, ...], out_dim: int, in_dim: int):
        args = (fmt, (*lead, out_dim, in_dim), self.dtype)
        if self.deferred:
            abstract = jax.eval_shape(_draw_weight, jax.ShapeDtypeStruct((2,), jnp.uint32), *args)
            return Drawn(abstract, lambda shardings: _draw_weight(self._key(module), *args, shardings)).tree()
        return _draw_weight(self._key(module), *args)


# One compiled draw per (kind, shape, dtype): a model has few distinct tensor shapes.
@partial(jax.jit, static_argnums=(1, 2, 3))
def _draw_vector(key, leaf: str, shape: tuple[int, ...], dtype):
    if leaf in ("norm", "norm_f", "D"):
        return jnp.ones(shape, dtype)
    if leaf == "A_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
    if leaf == "dt_bias":  # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, np.log(1e-3), np.log(1e-1)))
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
    if leaf in ("e_score_correction_bias", "bias"):
        scale = 0.01
    elif leaf in ("conv1d", "gate"):  # [C, 1, K] conv taps, [E, H] router: unit-variance outputs
        scale = 1.0 / np.sqrt(shape[-1])
    else:  # embeddings
        scale = 1.0
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _draw_weight(key, fmt: str | None, shape: tuple[int, ...], dtype, shardings=None):
    """A projection [..., out, in] with standard deviation 1/sqrt(in), stored in `fmt` (None: dense);
    shardings: where its leaves go (each device then draws only its own shard)."""
    w = _weight_values(key, fmt, shape, dtype)
    return w if shardings is None else jax.lax.with_sharding_constraint(w, shardings)


def _weight_values(key, fmt: str | None, shape: tuple[int, ...], dtype):
    """One projection's values (see the module docstring) in format `fmt` (None: dense in `dtype`)."""
    *lead, out_dim, in_dim = shape
    k1, k2 = jax.random.split(key)
    std = 1.0 / np.sqrt(in_dim)
    packed = jax.random.bits(k1, (*lead, out_dim, in_dim // 2), jnp.uint8)
    lo, hi = _BLOCK_SCALE_RANGE
    block = jax.random.uniform(k2, (*lead, out_dim, in_dim // NVFP4_BLOCK), jnp.float32, lo, hi)
    global_scale = std / (_E2M1_STD * np.sqrt((lo * lo + lo * hi + hi * hi) / 3))  # rms of the block scales
    nvfp4 = NVFP4Weight.from_hf(packed, block.astype(jnp.float8_e4m3fn), jnp.full(lead, global_scale, jnp.float32))
    if fmt == "NVFP4":
        return nvfp4
    if fmt is None:
        return nvfp4.dequantize(dtype)
    if fmt == "FP8":
        scale = std / _FP8_SPREAD
        return FP8Weight((nvfp4.dequantize() / scale).astype(jnp.float8_e4m3fn), jnp.full(lead, scale, jnp.float32))
    raise ValueError(f"no random values for format {fmt!r}")


def random_params(config: NemotronHConfig, layout: str = "dense", *, dtype=jnp.bfloat16, seed: int = 0, mesh=None,
                  rules=None) -> ModelParams:
    """Random ModelParams for `config` on the default device, or laid out over a jax Mesh by the rules
    (nemoh.sharding; default DEFAULT_RULES), each device drawing its own shard of every projection
    (the values do not depend on the mesh). MeshError before any drawing for a mesh axis that does not
    divide a dim it splits.

    layout: "dense" (every projection in `dtype`) or a quantiser recipe: "NANO_NVFP4" / "NANO_FP8" (the
    official Nano selective layouts), "NVFP4" / "FP8" (every linear but lm_head), "MIXED" (routed experts
    NVFP4, other projections FP8, attention and lm_head dense), or ModelOpt's MAMBA_MOE_* recipes (any of
    nemoh.io.quantize.ALGOS).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {list(LAYOUTS)}")
    if mesh is None:
        if rules is not None:
            raise RequestError(f"rules={rules!r}: needs a mesh: pass mesh=...")
        return build_params(config, _RandomReader(config, layout, dtype, seed)).committed()
    placement = make_placement(mesh, rules)
    params = build_params(config, _RandomReader(config, layout, dtype, seed, deferred=True))
    return place(params, check_params(params, placement))
