"""Read NVIDIA ModelOpt quantised checkpoints: the quantisation config (QuantSpec) and each linear's tensors.

Formats: pallas_kernels.formats. The config comes from hf_quant_config.json
({"quantization": {...}}) when present, else from config.json "quantization_config" (quant_method
"modelopt"); when both exist their quant_algo must agree and hf_quant_config.json's lists are used.
Every tensor is checked against what the config says the module is, so a checkpoint whose tensors and
config disagree fails at load with a CheckpointError naming the tensor and its file.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nemoh.errors import CheckpointError
from nemoh.io.tensor_source import SAFETENSORS_DTYPES, TensorSource
from pallas_kernels.formats import NVFP4_BLOCK, FP8Weight, NVFP4Weight, Weight

HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG = "config.json"
MIXED = "MIXED_PRECISION"
DENSE_DTYPES = ("F32", "BF16", "F16")
_ALGO_ALIASES = {"NVFP4": "NVFP4", "W4A16_NVFP4": "NVFP4", "FP8": "FP8"}  # stored name -> weight format
_QUANTISED_DTYPES = ("U8", "F8_E4M3", "F8_E5M2", "I8")


def matches_any(module: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether an fnmatch pattern (case-sensitive) of `patterns` names `module`."""
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """What a ModelOpt checkpoint says is quantised.

    quant_algo: "NVFP4" | "FP8" | "MIXED_PRECISION" | None (weights dense, only the KV cache quantised);
    exclude: fnmatch patterns of modules kept dense (NVFP4 / FP8); quantized_layers (MIXED_PRECISION only):
    sorted (module, "FP8" | "NVFP4") pairs, a module not listed being dense; kv_cache_quant_algo: None | "FP8";
    source: the file it was read from (named in errors).
    """

    quant_algo: str | None
    exclude: tuple[str, ...] = ()
    quantized_layers: tuple[tuple[str, str], ...] = ()
    kv_cache_quant_algo: str | None = None
    source: str = ""

    @functools.cached_property
    def _layer_algos(self) -> dict[str, str]:
        return dict(self.quantized_layers)

    def algo_for(self, module: str) -> str | None:
        """Weight format of one module: None (dense), "FP8" or "NVFP4". Under MIXED_PRECISION the explicit
        quantized_layers entry decides (an unlisted module is dense); otherwise the exclude patterns do."""
        if self.quant_algo == MIXED:
            return self._layer_algos.get(module)
        if self.quant_algo is None or matches_any(module, self.exclude):
            return None
        return self.quant_algo

    @classmethod
    def from_dir(cls, path: str | Path) -> QuantSpec | None:
        """Parse a checkpoint directory's quantisation config; None when the checkpoint is unquantised."""
        path = Path(path)
        specs = []
        if (path / HF_QUANT_CONFIG).exists():
            raw = _read_json(path / HF_QUANT_CONFIG)
            if not isinstance(raw.get("quantization"), dict):
                raise CheckpointError(f"{path / HF_QUANT_CONFIG}: no \"quantization\" object")
            specs.append(cls.from_hf_quant_config(raw["quantization"], str(path / HF_QUANT_CONFIG)))
        if (path / CONFIG).exists():
            qc = _read_json(path / CONFIG).get("quantization_config")
            if qc is not None:
                specs.append(cls.from_quantization_config(qc, f"{path / CONFIG} quantization_config"))
        if len(specs) == 2:  # config.json without a quant_algo (compressed-tensors style) adds nothing to check
            a, b = (s.quant_algo if s else None for s in specs)
            if b is not None and a != b:
                raise CheckpointError(f"{path}: {HF_QUANT_CONFIG} says quant_algo {a!r} but {CONFIG} says {b!r}")
        return specs[0] if specs else None

    @classmethod
    def from_hf_quant_config(cls, section: dict, source: str) -> QuantSpec | None:
        """From hf_quant_config.json's "quantization" object (quant_algo, group_size, kv_cache_quant_algo,
        exclude_modules, quantized_layers)."""
        return cls._build(section, section.get("exclude_modules"), section.get("kv_cache_quant_algo"), source)

    @classmethod
    def from_quantization_config(cls, qc: dict, source: str) -> QuantSpec | None:
        """From config.json's "quantization_config" (quant_method "modelopt", quant_algo, ignore,
        kv_cache_scheme, quantized_layers)."""
        if not isinstance(qc, dict):
            raise CheckpointError(f"{source}: not a JSON object")
        method = qc.get("quant_method")
        if str(method).lower() != "modelopt":
            raise CheckpointError(f"{source}: quant_method {method!r} is not supported (only \"modelopt\")")
        return cls._build(qc, qc.get("ignore"), _kv_algo_of_scheme(qc.get("kv_cache_scheme"), source), source)

    @classmethod
    def _build(cls, section: dict, exclude, kv_algo, source: str) -> QuantSpec | None:
        """Validate the fields both config spellings share; None when nothing is quantised."""
        if not isinstance(section, dict):
            raise CheckpointError(f"{source}: not a JSON object")
        algo = section.get("quant_algo")
        if algo is not None and algo != MIXED:
            algo = _weight_format(algo, section.get("group_size"), f"{source} quant_algo")
        if kv_algo not in (None, "FP8"):
            raise CheckpointError(f"{source}: kv_cache_quant_algo {kv_algo!r} is not supported (only FP8)")
        if exclude is None:
            exclude = []
        if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
            raise CheckpointError(f"{source}: exclude/ignore must be a list of strings, got {exclude!r}")
        layers = section.get("quantized_layers") or {}
        if algo == MIXED and not isinstance(layers, dict):
            raise CheckpointError(f"{source}: quantized_layers must be an object, got {layers!r}")
        if algo is None and kv_algo is None:
            return None
        per_module = tuple(sorted((m, _layer_format(m, cfg, source)) for m, cfg in layers.items())) \
            if algo == MIXED else ()
        return cls(algo, tuple(exclude), per_module, kv_algo, source)


def _layer_format(module: str, cfg, source: str) -> str:
    """One quantized_layers entry ({"quant_algo": ..., "group_size": ...}) -> "NVFP4" | "FP8"."""
    if not isinstance(cfg, dict) or "quant_algo" not in cfg:
        raise CheckpointError(f"{source}: quantized_layers entry for module {module} has no quant_algo: {cfg!r}")
    return _weight_format(cfg["quant_algo"], cfg.get("group_size"), f"{source} module {module}")


def _weight_format(algo, group_size, where: str) -> str:
    """A stored quant_algo (+ group_size) -> "NVFP4" | "FP8"; CheckpointError naming `where` otherwise."""
    fmt = _ALGO_ALIASES.get(algo) if isinstance(algo, str) else None
    if fmt is None:
        raise CheckpointError(f"{where}: quant_algo {algo!r} is not supported (supported: "
                              f"{sorted(_ALGO_ALIASES)} and {MIXED})")
    if fmt == "NVFP4" and group_size not in (None, NVFP4_BLOCK):
        raise CheckpointError(f"{where}: NVFP4 group_size {group_size!r} is not supported (only {NVFP4_BLOCK})")
    return fmt


def _kv_algo_of_scheme(scheme, source: str) -> str | None:
    """config.json kv_cache_scheme (None, "FP8" or {"num_bits": 8, "type": "float", ...}) -> None | "FP8"."""
    if scheme is None or isinstance(scheme, str):
        return scheme
    if isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type") == "float":
        return "FP8"
    raise CheckpointError(f"{source}: kv_cache_scheme {scheme!r} is not supported (only 8-bit float)")


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return raw


def _scalar(src: TensorSource, name: str) -> jnp.ndarray:
    """A float32 0-d scale tensor, checked finite and >= 0."""
    value = src.get(name, shape=(), dtypes=("F32",))
    if not (np.isfinite(value) and value >= 0):
        raise CheckpointError(f"tensor {name} in {src.file_of(name)}: scale {float(value)} is not finite and >= 0")
    return jnp.asarray(value, jnp.float32)


def _mark_input_scale(src: TensorSource, module: str) -> None:
    """Accept an activation scale without loading it: nemoh's kernels are weight-only (W8A16 / W4A16)."""
    if src.has(module + ".input_scale"):
        src.mark_used(module + ".input_scale")


def _read_dense(src: TensorSource, module: str, spec: QuantSpec | None, shape, dtype) -> jnp.ndarray:
    """A module the config leaves dense: [out, in] F32/BF16/F16 -> jnp `dtype`; quantised tensors are refused."""
    name, scale = module + ".weight", module + ".weight_scale"
    culprit = name if src.dtype_of(name) in _QUANTISED_DTYPES else scale if src.has(scale) else None
    if culprit:
        said = f"{spec.source} does not quantise {module}" if spec else "there is no quantisation config"
        raise CheckpointError(f"tensor {culprit} in {src.file_of(culprit)}: quantised tensor where the config "
                              f"says excluded ({said})")
    return jnp.asarray(src.get(name, shape=shape, dtypes=DENSE_DTYPES), dtype)


def _refuse_dense(src: TensorSource, module: str, algo: str, spec: QuantSpec) -> None:
    """CheckpointError when a module the config quantises is stored as a plain float weight."""
    name = module + ".weight"
    if src.dtype_of(name) in DENSE_DTYPES:
        raise CheckpointError(f"tensor {name} in {src.file_of(name)}: stored dense ({src.dtype_of(name)}) where "
                              f"{spec.source} says {module} is {algo}")


def stored_tensors(algo: str, module: str, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a quantised module of logical shape [out, in] is stored as: {suffix: (shape,
    safetensors dtype)}, in the order its format's from_hf takes them."""
    out_dim, in_dim = shape
    if algo == "FP8":
        return {"weight": (tuple(shape), "F8_E4M3"), "weight_scale": ((), "F32")}
    if in_dim % NVFP4_BLOCK:
        raise CheckpointError(f"module {module}: NVFP4 needs the input dim divisible by {NVFP4_BLOCK}, "
                              f"the config gives shape {list(shape)}")
    return {"weight": ((out_dim, in_dim // 2), "U8"), "weight_scale": ((out_dim, in_dim // NVFP4_BLOCK), "F8_E4M3"),
            "weight_scale_2": ((), "F32")}


_FORMATS = {"FP8": FP8Weight, "NVFP4": NVFP4Weight}


def abstract_linear(spec: QuantSpec | None, module: str, shape: tuple[int, int], dtype) -> Weight:
    """What read_linear gives for `module`, with jax.ShapeDtypeStruct leaves: nothing is read."""
    algo = spec.algo_for(module) if spec else None
    if algo is None:
        return jax.ShapeDtypeStruct(tuple(shape), dtype)
    stored = [jax.ShapeDtypeStruct(s, SAFETENSORS_DTYPES[d]) for s, d in stored_tensors(algo, module, shape).values()]
    return jax.eval_shape(_FORMATS[algo].from_hf, *stored)


def read_linear(src: TensorSource, module: str, spec: QuantSpec | None, shape: tuple[int, int], dtype) -> Weight:
    """Load one linear module's weight, logical shape [out, in], in the format the config gives it.

    Dense: a jnp array of `dtype` (stored F32/BF16/F16). FP8 / NVFP4: FP8Weight / NVFP4Weight built
    from the stored tensors (`from_hf`, in the kernels' layout); `dtype` is unused for quantised weights. An ".input_scale" is accepted and marked used, never loaded.
    """
    algo = spec.algo_for(module) if spec else None
    if algo is None:
        return _read_dense(src, module, spec, shape, dtype)
    _refuse_dense(src, module, algo, spec)
    stored = {}
    for suffix, (tensor_shape, tensor_dtype) in stored_tensors(algo, module, shape).items():
        name = f"{module}.{suffix}"
        stored[suffix] = _scalar(src, name) if tensor_shape == () else src.get(name, tensor_shape, (tensor_dtype,))
    if algo == "NVFP4" and np.isnan(stored["weight_scale"].astype(np.float32)).any():
        name = module + ".weight_scale"
        raise CheckpointError(f"tensor {name} in {src.file_of(name)}: NaN block scale")
    _mark_input_scale(src, module)
    return _FORMATS[algo].from_hf(*stored.values())


def read_kv_scales(src: TensorSource, module_prefix: str) -> tuple[jnp.ndarray, jnp.ndarray] | None:
    """FP8 KV-cache scales of one attention mixer (e.g. "backbone.layers.5.mixer"): the float32 scalars
    {prefix}.k_proj.k_scale and {prefix}.v_proj.v_scale, or None when the checkpoint has neither."""
    k_name, v_name = f"{module_prefix}.k_proj.k_scale", f"{module_prefix}.v_proj.v_scale"
    if not src.has(k_name) and not src.has(v_name):
        return None
    for present, absent in ((k_name, v_name), (v_name, k_name)):
        if src.has(present) and not src.has(absent):
            raise CheckpointError(f"tensor {present} in {src.file_of(present)} has no partner: {absent} is missing")
    return _scalar(src, k_name), _scalar(src, v_name)
