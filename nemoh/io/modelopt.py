"""Read NVIDIA ModelOpt quantised checkpoints: the quantisation config (QuantSpec) and each linear's tensors.

Formats: pallas_kernels.formats. The config comes from hf_quant_config.json
({"quantization": {...}}) when present, else from config.json "quantization_config" (quant_method
"modelopt"); when both exist their quant_algo must agree and hf_quant_config.json's lists are used.
Module names are read as ModelOpt writes them: a name carrying its export marker (".<NUL>..._name_sentinel",
left behind by ModelOpt 0.47's model.->backbone. rename) is cut back to the module name, and a module
named in exclude_modules / quantized_layers covers the submodules beneath it at a "." boundary (e.g. one
"backbone.layers.2.mixer.experts" entry for every routed expert). Every tensor is checked against what
the config says the module is, so a checkpoint whose tensors and config disagree fails at load with a
CheckpointError naming the tensor and its file.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nemoh.errors import CheckpointError
from nemoh.io.json_file import read_json
from nemoh.io.tensor_source import SAFETENSORS_DTYPES, TensorSource
from pallas_kernels.formats import NVFP4_BLOCK, FP8Weight, NVFP4Weight, Weight

HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG = "config.json"
MIXED = "MIXED_PRECISION"
DENSE_DTYPES = ("F32", "BF16", "F16")
# stored quant_algo -> (weight format, activation format or None for weight-only)
ALGO_FORMATS = {"NVFP4": ("NVFP4", "NVFP4"), "W4A16_NVFP4": ("NVFP4", None), "FP8": ("FP8", "FP8")}
_QUANTISED_DTYPES = ("U8", "F8_E4M3", "F8_E5M2", "I8")
# ModelOpt 0.47 appends ".\x00modelopt_name_sentinel" to a name before renaming it and strips it after; its
# model.->backbone. rename rewrites the marker first ("\x00backbone.pt_name_sentinel"), so the strip misses.
_NAME_MARKER = re.compile(r"\.\x00[^\x00]*_name_sentinel(\.?\*)?\Z")


def matches_any(module: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether an fnmatch pattern (case-sensitive) of `patterns` names `module`."""
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def module_and_parents(module: str) -> list[str]:
    """"a.b.c" -> ["a.b.c", "a.b", "a"]: the module and every module above it at a "." boundary."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def normalise_module_name(name: str, where: str) -> str:
    """A module name or pattern as ModelOpt meant it: its export marker cut off, a trailing "*" / ".*" kept.

    A NUL never occurs in a real module name, so one anywhere but in the marker is a CheckpointError."""
    if "\x00" not in name:
        return name
    hit = _NAME_MARKER.search(name)
    if hit is None or "\x00" in name[: hit.start()]:
        raise CheckpointError(f"{where}: module name {name!r} holds a NUL byte that is not ModelOpt's name marker")
    return name[: hit.start()] + (hit.group(1) or "")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """What a ModelOpt checkpoint says is quantised.

    quant_algo: "NVFP4" | "W4A16_NVFP4" | "FP8" | "MIXED_PRECISION" | None (weights dense, only the KV
    cache quantised); exclude: fnmatch patterns of modules kept dense (not MIXED_PRECISION);
    quantized_layers (MIXED_PRECISION only): sorted (module, quant_algo) pairs, a module covered by none
    being dense; kv_cache_quant_algo: None | "FP8"; source: the file it was read from (named in errors).
    Module names are normalised (`normalise_module_name`); an entry covers the submodules beneath it.
    """

    quant_algo: str | None
    exclude: tuple[str, ...] = ()
    quantized_layers: tuple[tuple[str, str], ...] = ()
    kv_cache_quant_algo: str | None = None
    source: str = ""

    @functools.cached_property
    def _layer_algos(self) -> dict[str, str]:
        return dict(self.quantized_layers)

    @functools.cached_property
    def _exclude_re(self) -> re.Pattern:
        """The exclude patterns as one regular expression (fnmatchcase semantics): one match per scope,
        not one per pattern, across the thousands of modules a load looks up."""
        return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in self.exclude) or "(?!)")

    def stored_algo_for(self, module: str) -> str | None:
        """The quant_algo that covers one module ("NVFP4", "W4A16_NVFP4", "FP8"), None when it is dense.
        Under MIXED_PRECISION the nearest quantized_layers entry at or above the module decides; otherwise
        the module is dense when it or a module above it matches an exclude pattern."""
        scopes = module_and_parents(module)
        if self.quant_algo == MIXED:
            return next((self._layer_algos[m] for m in scopes if m in self._layer_algos), None)
        if self.quant_algo is None or any(self._exclude_re.match(m) for m in scopes):
            return None
        return self.quant_algo

    def algo_for(self, module: str) -> str | None:
        """Weight format of one module: None (dense), "FP8" or "NVFP4"."""
        algo = self.stored_algo_for(module)
        return ALGO_FORMATS[algo][0] if algo else None

    def activation_algo_for(self, module: str) -> str | None:
        """Activation format the config gives one module: "FP8", "NVFP4" or None (weight-only / dense)."""
        algo = self.stored_algo_for(module)
        return ALGO_FORMATS[algo][1] if algo else None

    @classmethod
    def from_dir(cls, path: str | Path) -> QuantSpec | None:
        """Parse a checkpoint directory's quantisation config; None when the checkpoint is unquantised."""
        path = Path(path)
        specs = []
        if (path / HF_QUANT_CONFIG).exists():
            raw = read_json(path / HF_QUANT_CONFIG)
            if not isinstance(raw.get("quantization"), dict):
                raise CheckpointError(f"{path / HF_QUANT_CONFIG}: no \"quantization\" object")
            specs.append(cls.from_hf_quant_config(raw["quantization"], str(path / HF_QUANT_CONFIG)))
        if (path / CONFIG).exists():
            qc = read_json(path / CONFIG).get("quantization_config")
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
            algo = _checked_algo(algo, section.get("group_size"), f"{source} quant_algo")
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
        exclude = tuple(normalise_module_name(p, f"{source} exclude") for p in exclude)
        per_module: dict[str, str] = {}
        for raw, cfg in (layers.items() if algo == MIXED else ()):
            module = normalise_module_name(raw, f"{source} quantized_layers")
            layer_algo = _layer_algo(module, cfg, source)
            if per_module.setdefault(module, layer_algo) != layer_algo:
                raise CheckpointError(f"{source}: quantized_layers names module {module} twice, as "
                                      f"{per_module[module]} and {layer_algo}")
        return cls(algo, exclude, tuple(sorted(per_module.items())), kv_algo, source)


def _layer_algo(module: str, cfg, source: str) -> str:
    """One quantized_layers entry ({"quant_algo": ..., "group_size": ...}) -> its quant_algo."""
    if not isinstance(cfg, dict) or "quant_algo" not in cfg:
        raise CheckpointError(f"{source}: quantized_layers entry for module {module} has no quant_algo: {cfg!r}")
    return _checked_algo(cfg["quant_algo"], cfg.get("group_size"), f"{source} module {module}")


def _checked_algo(algo, group_size, where: str) -> str:
    """A stored quant_algo (+ group_size), checked: "NVFP4" | "W4A16_NVFP4" | "FP8"; CheckpointError
    naming `where` otherwise."""
    if not isinstance(algo, str) or algo not in ALGO_FORMATS:
        raise CheckpointError(f"{where}: quant_algo {algo!r} is not supported (supported: "
                              f"{sorted(ALGO_FORMATS)} and {MIXED})")
    if ALGO_FORMATS[algo][0] == "NVFP4" and group_size not in (None, NVFP4_BLOCK):
        raise CheckpointError(f"{where}: NVFP4 group_size {group_size!r} is not supported (only {NVFP4_BLOCK})")
    return algo


def _kv_algo_of_scheme(scheme, source: str) -> str | None:
    """config.json kv_cache_scheme (None, "FP8" or {"num_bits": 8, "type": "float", ...}) -> None | "FP8"."""
    if scheme is None or isinstance(scheme, str):
        return scheme
    if isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type") == "float":
        return "FP8"
    raise CheckpointError(f"{source}: kv_cache_scheme {scheme!r} is not supported (only 8-bit float)")


def _scalar(src: TensorSource, name: str, positive: bool = False) -> np.ndarray:
    """A float32 0-d scale tensor (host), checked finite and >= 0 (> 0 when `positive`)."""
    value = src.get(name, shape=(), dtypes=("F32",))
    if not (np.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise CheckpointError(f"tensor {name} in {src.file_of(name)}: scale {float(value)} is not finite and "
                              f"{'> 0' if positive else '>= 0'}")
    return np.asarray(value, np.float32)


def _input_scale(src: TensorSource, module: str, spec: QuantSpec, activation_quant: bool) -> np.ndarray | None:
    """The activation scale a quantised module runs with: its ".input_scale" when `activation_quant` and the
    config quantises the module's activations (a missing one is a CheckpointError), else None (weight-only;
    a stored input_scale is accepted and left unused)."""
    name = module + ".input_scale"
    act = spec.activation_algo_for(module) if activation_quant else None
    if act is None:
        if src.has(name):
            src.mark_used(name)
        return None
    if not src.has(name):
        raise CheckpointError(f"tensor {name} is missing from the checkpoint in {src.directory}: {spec.source} "
                              f"quantises the activations of {module} ({act}); load with activation_quant=False "
                              f"to run it weight-only")
    return _scalar(src, name, positive=True)


def _read_dense(src: TensorSource, module: str, spec: QuantSpec | None, shape, view: bool = False) -> np.ndarray:
    """A module the config leaves dense: [out, in] F32/BF16/F16 (host); quantised tensors are refused."""
    name, scale = module + ".weight", module + ".weight_scale"
    culprit = name if src.dtype_of(name) in _QUANTISED_DTYPES else scale if src.has(scale) else None
    if culprit:
        said = f"{spec.source} does not quantise {module}" if spec else "there is no quantisation config"
        raise CheckpointError(f"tensor {culprit} in {src.file_of(culprit)}: quantised tensor where the config "
                              f"says excluded ({said})")
    return src.get(name, shape=shape, dtypes=DENSE_DTYPES, view=view)


def _refuse_dense(src: TensorSource, module: str, algo: str, spec: QuantSpec) -> None:
    """CheckpointError when a module the config quantises is stored as a plain float weight."""
    name = module + ".weight"
    if src.dtype_of(name) in DENSE_DTYPES:
        raise CheckpointError(f"tensor {name} in {src.file_of(name)}: stored dense ({src.dtype_of(name)}) where "
                              f"{spec.source} says {module} is {algo}")


def stored_tensors(algo: str, module: str, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a quantised module of logical shape [out, in] is stored as: {suffix: (shape,
    safetensors dtype)}, in the order its format's from_hf takes them (the optional input_scale aside)."""
    out_dim, in_dim = shape
    if algo == "FP8":
        return {"weight": (tuple(shape), "F8_E4M3"), "weight_scale": ((), "F32")}
    if in_dim % NVFP4_BLOCK:
        raise CheckpointError(f"module {module}: NVFP4 needs the input dim divisible by {NVFP4_BLOCK}, "
                              f"the config gives shape {list(shape)}")
    return {"weight": ((out_dim, in_dim // 2), "U8"), "weight_scale": ((out_dim, in_dim // NVFP4_BLOCK), "F8_E4M3"),
            "weight_scale_2": ((), "F32")}


WEIGHT_FORMATS = {"FP8": FP8Weight, "NVFP4": NVFP4Weight}  # weight quant_algo -> the format nemoh holds it in


def abstract_linear(spec: QuantSpec | None, module: str, shape: tuple[int, int], dtype,
                    activation_quant: bool = False) -> Weight:
    """What read_linear gives for `module`, with jax.ShapeDtypeStruct leaves: nothing is read."""
    algo = spec.algo_for(module) if spec else None
    if algo is None:
        return jax.ShapeDtypeStruct(tuple(shape), dtype)
    stored = [jax.ShapeDtypeStruct(s, SAFETENSORS_DTYPES[d]) for s, d in stored_tensors(algo, module, shape).values()]
    if activation_quant and spec.activation_algo_for(module):
        stored.append(jax.ShapeDtypeStruct((), jnp.float32))
    return jax.eval_shape(WEIGHT_FORMATS[algo].from_hf, *stored)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tensors", "input_scale"], meta_fields=["algo"])
@dataclasses.dataclass(frozen=True)
class StoredLinear:
    """One linear module's tensors as stored, read and checked on the host: algo None (dense: tensors is
    the [out, in] weight) or "FP8" / "NVFP4" (tensors: the stored arrays in the order the format's
    from_hf takes them); input_scale: the activation scale it runs with, or None (weight-only). A pytree
    of host arrays, so the experts of a layer stack leaf by leaf before one conversion."""

    algo: str | None
    tensors: np.ndarray | tuple[np.ndarray, ...]
    input_scale: np.ndarray | None

    def to_weight(self, dtype) -> Weight:
        """The weight nemoh holds (leading dims kept, so a stack of experts converts in one go): dense as a
        jnp array of `dtype`, quantised as FP8Weight / NVFP4Weight in the kernels' layout."""
        if self.algo is None:
            return jnp.asarray(self.tensors, dtype)
        return WEIGHT_FORMATS[self.algo].from_hf(*self.tensors, self.input_scale)


def read_stored_linear(src: TensorSource, module: str, spec: QuantSpec | None, shape: tuple[int, int],
                       activation_quant: bool = False, views: bool = False) -> StoredLinear:
    """Read one linear module, logical shape [out, in], in the format the config gives it (see read_linear).
    views: its weight tensors as views of the file (TensorSource.get), for a caller that copies them at once."""
    algo = spec.algo_for(module) if spec else None
    if algo is None:
        return StoredLinear(None, _read_dense(src, module, spec, shape, views), None)
    _refuse_dense(src, module, algo, spec)
    input_scale = _input_scale(src, module, spec, activation_quant)
    stored = {}
    for suffix, (tensor_shape, tensor_dtype) in stored_tensors(algo, module, shape).items():
        name = f"{module}.{suffix}"
        stored[suffix] = (_scalar(src, name) if tensor_shape == () else
                          src.get(name, tensor_shape, (tensor_dtype,), view=views))
    if algo == "NVFP4" and (stored["weight_scale"].view(np.uint8) & 0x7F == 0x7F).any():  # e4m3fn's NaNs
        name = module + ".weight_scale"
        raise CheckpointError(f"tensor {name} in {src.file_of(name)}: NaN block scale")
    return StoredLinear(algo, tuple(stored.values()), input_scale)


def read_linear(src: TensorSource, module: str, spec: QuantSpec | None, shape: tuple[int, int], dtype,
                activation_quant: bool = False) -> Weight:
    """Load one linear module's weight, logical shape [out, in], in the format the config gives it.

    Dense: a jnp array of `dtype` (stored F32/BF16/F16). FP8 / NVFP4: FP8Weight / NVFP4Weight built
    from the stored tensors (`from_hf`, in the kernels' layout); `dtype` is unused for quantised weights.
    activation_quant: give the weight its ".input_scale" where the config quantises the module's
    activations (W8A8 / W4A4); otherwise the weight is weight-only and an input_scale is left unused.
    """
    return read_stored_linear(src, module, spec, shape, activation_quant).to_weight(dtype)


def read_kv_scales(src: TensorSource, module_prefix: str) -> tuple[np.ndarray, np.ndarray] | None:
    """FP8 KV-cache scales of one attention mixer (e.g. "backbone.layers.5.mixer"): the float32 scalars
    {prefix}.k_proj.k_scale and {prefix}.v_proj.v_scale, or None when the checkpoint has neither."""
    k_name, v_name = f"{module_prefix}.k_proj.k_scale", f"{module_prefix}.v_proj.v_scale"
    if not src.has(k_name) and not src.has(v_name):
        return None
    for present, absent in ((k_name, v_name), (v_name, k_name)):
        if src.has(present) and not src.has(absent):
            raise CheckpointError(f"tensor {present} in {src.file_of(present)} has no partner: {absent} is missing")
    return _scalar(src, k_name), _scalar(src, v_name)
