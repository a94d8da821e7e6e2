"""Quantise a dense Hugging Face NemotronH checkpoint into a ModelOpt-format (NVFP4 / FP8) checkpoint.

It writes what NVIDIA ModelOpt 0.47 (`mtq.quantize` + `export_hf_checkpoint`) writes for the same recipe:
the tensor formats of pallas_kernels.formats with the arithmetic of ModelOpt's weight export (fp32), so
a weight quantised here has the bytes ModelOpt would write, and the same hf_quant_config.json and
config.json "quantization_config" fields (module names as ModelOpt means them, without its name marker):

    NVFP4  weight_scale_2 = amax(|W|) / (6*448)                          float32 scalar; one shared value, the
                                                                         largest, for the NVFP4 projections that
                                                                         read the same input (q/k/v; shared-expert
                                                                         up + latent fc1)
           weight_scale   = fp8_e4m3(clip(amax(block16) / (6*weight_scale_2), 2^-9, 448)), 1.0 for an all-zero block
           codes          = e2m1 round-to-nearest-even of W / (weight_scale*weight_scale_2), saturating at 6,
                            sign bit set for every W < 0; two codes a byte, even input index in the low nibble
    FP8    weight_scale   = amax(|W|) / 448;  weight = fp8_e4m3(clip(W / weight_scale, +-448)), the quotient
                            rounded to the source dtype first (ModelOpt divides in the weight's dtype)
    input_scale (only with calibration, `input_amax`: the amax of each projection's input activations)
           FP8 amax / 448, NVFP4 amax / (6*448) (the largest amax of a shared-input NVFP4 group)

Without calibration no input_scale is written and NVFP4 is declared "W4A16_NVFP4" (weight-only), as
ModelOpt does for its weight-only recipe; FP8 stays "FP8" and can then only run weight-only. No KV-cache
scales are written. Where ModelOpt would emit NaN (an all-zero tensor, scale 0) this writes zero codes.
Recipes (`algo`):
    NVFP4 / FP8          every linear except `exclude` (default ["lm_head"])
    NANO_NVFP4 / NANO_FP8 the official Nano layout: BF16 lm_head, attention q/k/v/o and the in/out_proj of
                         Mamba layers next to an attention layer; the rest NVFP4 / FP8
    MAMBA_MOE_{NVFP4,FP8}_{CONSERVATIVE,AGGRESSIVE}  ModelOpt's Mamba-MoE recipes: attention and latent
                         projections dense; CONSERVATIVE also keeps the Mamba in/out_proj dense
    MIXED                MIXED_PRECISION: routed experts NVFP4, other projections FP8, attention + lm_head dense
CLI: python -m nemoh.io.quantize SRC DST --algo NVFP4 [--exclude PATTERN ...] [--input-amax AMAX.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from nemoh.config import ATTENTION, MAMBA, NemotronHConfig
from nemoh.errors import CheckpointError
from nemoh.io.layout import hf_layout
from nemoh.io.json_file import read_json
from nemoh.io.modelopt import CONFIG, DENSE_DTYPES, HF_QUANT_CONFIG, MIXED, matches_any
from nemoh.io.tensor_source import INDEX_FILE, SINGLE_FILE, TensorSource
from pallas_kernels.formats import FP8_MAX as _FP8_MAX
from pallas_kernels.formats import NVFP4_BLOCK

FP8_MAX = np.float32(_FP8_MAX)
E2M1_MAX = np.float32(6.0)
ALGOS = ("NVFP4", "FP8", "MIXED", "NANO_NVFP4", "NANO_FP8", "MAMBA_MOE_NVFP4_CONSERVATIVE",
         "MAMBA_MOE_NVFP4_AGGRESSIVE", "MAMBA_MOE_FP8_CONSERVATIVE", "MAMBA_MOE_FP8_AGGRESSIVE")
DEFAULT_EXCLUDE = ("lm_head",)
DEFAULT_SHARD_BYTES = 4 << 30
PRODUCER = {"name": "nemoh.io.quantize"}

_ATTENTION_PROJ = re.compile(r"\.mixer\.[qkvo]_proj$")
_LATENT_PROJ = re.compile(r"\.mixer\.fc[12]_latent_proj$")
_MAMBA_PROJ = re.compile(r"\.mixer\.(in_proj|out_proj)$")
_ROUTED_EXPERT = re.compile(r"^(.+\.mixer\.experts)\.\d+\.(up_proj|down_proj)$")
_BACKBONE_MAMBA_PROJ = re.compile(r"^backbone\.layers\.(\d+)\.mixer\.(in_proj|out_proj)$")
# projections of one mixer that read its input: ModelOpt shares their NVFP4 global scale and input amax
_SHARED_INPUT = re.compile(r"^(.+\.mixer)\.([qkv]_proj|shared_experts\.up_proj|fc1_latent_proj)$")


def _e2m1_table() -> np.ndarray:
    """float32 [16]: value of each e2m1 code, decoded from its bits (bit 3 sign, bits 2-1 exponent, bit 0
    mantissa, exponent bias 1, exponent 0 subnormal) rather than typed in, so it checks the literal tables."""
    table = np.empty(16, np.float32)
    for code in range(16):
        exp, man = (code >> 1) & 3, code & 1
        mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
        table[code] = -mag if code & 8 else mag
    return table


E2M1_VALUES = _e2m1_table()  # [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6]
_E2M1_MIDPOINTS = (E2M1_VALUES[1:8] + E2M1_VALUES[:7]) / 2  # [.25, .75, 1.25, 1.75, 2.5, 3.5, 5]


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint8 e2m1 codes [...]: nearest grid value, ties to the even code, |x| > 6 -> 6.

    The sign bit is set for every x < 0 (so a tiny negative value becomes -0, code 8), as ModelOpt does.
    """
    mag = np.abs(x)
    code = np.searchsorted(_E2M1_MIDPOINTS, mag, side="left")  # a tie lands on the lower neighbour
    on_tie = mag == _E2M1_MIDPOINTS[np.minimum(code, len(_E2M1_MIDPOINTS) - 1)]
    code = code + (on_tie & (code % 2 == 1))  # a tie whose lower neighbour is odd goes up to the even one
    return (code + 8 * (x < 0)).astype(np.uint8)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., n] -> uint8 [..., n/2]: byte k = (codes[2k+1] << 4) | codes[2k]."""
    return ((codes[..., 1::2] << 4) | codes[..., 0::2]).astype(np.uint8)


def nvfp4_global_scale(w: np.ndarray) -> np.float32:
    """weight_scale_2 of one weight on its own: amax(|W|) / (6*448), float32."""
    return np.float32(np.max(np.abs(np.asarray(w, np.float32)), initial=0.0)) / (E2M1_MAX * FP8_MAX)


def nvfp4_quantize(w: np.ndarray, global_scale: np.float32 | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [out, in] (in % 16 == 0) -> (packed uint8 [out, in/2], weight_scale fp8 [out, in/16],
    weight_scale_2 float32 scalar), computed in float32 with ModelOpt's operation order. global_scale:
    a weight_scale_2 shared with other projections (default: this weight's own)."""
    w = np.asarray(w, np.float32)
    out_dim, in_dim = w.shape
    blocks = w.reshape(out_dim, in_dim // NVFP4_BLOCK, NVFP4_BLOCK)
    global_scale = nvfp4_global_scale(w) if global_scale is None else np.float32(global_scale)
    block_amax = np.max(np.abs(blocks), axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero tensor gives 0 / 0 = NaN here
        block = block_amax / (E2M1_MAX * global_scale)
    # all-zero block (0) or tensor (NaN) -> 1.0; a tiny block is clamped to the smallest fp8 subnormal, not 0
    block = np.where(block > 0, np.clip(block, np.float32(2.0**-9), FP8_MAX), np.float32(1.0))
    block_fp8 = block.astype(ml_dtypes.float8_e4m3fn)
    denom = block_fp8.astype(np.float32) * global_scale
    scaled = np.divide(blocks, denom[..., None], out=np.zeros_like(blocks), where=denom[..., None] != 0)
    codes = e2m1_encode(scaled.reshape(out_dim, in_dim))
    return pack_nibbles(codes), block_fp8, np.asarray(global_scale, np.float32)


def fp8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [out, in] -> (weight float8_e4m3fn [out, in], weight_scale float32 scalar = amax/448). The quotient
    W / scale is computed in float32 and rounded to W's dtype before the fp8 cast (as ModelOpt's export
    divides a bf16 weight by a 0-d float32 scale in bf16)."""
    scale = np.float32(np.max(np.abs(np.asarray(w, np.float32)), initial=0.0)) / FP8_MAX
    wf = np.asarray(w, np.float32)
    scaled = np.divide(wf, scale, out=np.zeros_like(wf), where=scale != 0).astype(w.dtype).astype(np.float32)
    data = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return data, np.asarray(scale, np.float32)


def input_scale(amax: float, fmt: str) -> np.ndarray:
    """A projection's input_scale from the amax of its calibrated input: FP8 amax/448, NVFP4 amax/(6*448)."""
    return np.asarray(np.float32(amax) / (FP8_MAX * (E2M1_MAX if fmt == "NVFP4" else np.float32(1))), np.float32)


def quantize_tensor(name: str, w: np.ndarray, fmt: str, global_scale: np.float32 | None = None
                    ) -> dict[str, np.ndarray]:
    """One linear's dense ".weight" -> its quantised tensors keyed by suffix (".weight", ".weight_scale", ...)."""
    if not np.all(np.isfinite(w.astype(np.float32))):
        raise CheckpointError(f"tensor {name}: non-finite values cannot be quantised")
    if fmt == "FP8":
        data, scale = fp8_quantize(w)
        return {".weight": data, ".weight_scale": scale}
    packed, block, glob = nvfp4_quantize(w, global_scale)
    return {".weight": packed, ".weight_scale": block, ".weight_scale_2": glob}


def linear_modules(cfg: NemotronHConfig) -> list[str]:
    """The projections of `cfg` (the loader's layout table), in loading order: the modules quantised."""
    return [s.name for s in hf_layout(cfg) if s.projection]


def config_modules(cfg: NemotronHConfig) -> list[str]:
    """The modules ModelOpt's configs name for `cfg`: the projections, each layer's routed experts as one
    module (".mixer.experts"), and the non-linear modules it attaches quantisers to (embeddings, conv1d,
    router gate)."""
    out = []
    for s in hf_layout(cfg):
        name = s.name if s.projection else s.name.removesuffix(".weight")
        hit = _ROUTED_EXPERT.match(name)
        if hit:
            name = hit.group(1)
        elif not s.projection and (not s.name.endswith(".weight") or len(s.shape) < 2):
            continue  # norms, SSM parameters, biases
        if name not in out:
            out.append(name)
    return out


def _nano_adjacent_mamba(modules: list[str], layer_kinds: tuple[str, ...]) -> set[str]:
    """in/out_proj of the backbone Mamba layers immediately before or after an attention layer."""
    def next_to_attention(i: int) -> bool:
        return any(0 <= j < len(layer_kinds) and layer_kinds[j] == ATTENTION for j in (i - 1, i + 1))

    kept = set()
    for m in modules:
        hit = _BACKBONE_MAMBA_PROJ.match(m)
        i = int(hit.group(1)) if hit else len(layer_kinds)
        if i < len(layer_kinds) and layer_kinds[i] == MAMBA and next_to_attention(i):
            kept.add(m)
    return kept


def plan_modules(algo: str, modules: list[str], layer_kinds: tuple[str, ...],
                 exclude: list[str] | None = None) -> dict[str, str | None]:
    """Recipe -> {module: "NVFP4" | "FP8" | None (kept dense)} for every linear module."""
    if algo not in ALGOS:
        raise ValueError(f"unknown quantisation algo {algo!r}; choose one of {list(ALGOS)}")
    patterns = list(DEFAULT_EXCLUDE if exclude is None else exclude)
    kept = {m for m in modules if matches_any(m, patterns)}
    dense_kinds = [_ATTENTION_PROJ] if algo == "MIXED" or algo.startswith("NANO_") else []
    if algo.startswith("MAMBA_MOE_"):
        dense_kinds = [_ATTENTION_PROJ, _LATENT_PROJ] + ([_MAMBA_PROJ] if algo.endswith("_CONSERVATIVE") else [])
    kept |= {m for m in modules if any(r.search(m) for r in dense_kinds)}
    if algo.startswith("NANO_"):
        kept |= _nano_adjacent_mamba(modules, layer_kinds)
    if algo == "MIXED":
        return {m: None if m in kept else ("NVFP4" if _ROUTED_EXPERT.match(m) else "FP8") for m in modules}
    fmt = "NVFP4" if "NVFP4" in algo else "FP8"
    return {m: None if m in kept else fmt for m in modules}


def stored_algos(plan: dict[str, str | None], calibrated: bool) -> dict[str, str | None]:
    """{module: weight format} -> {module: the quant_algo ModelOpt declares}: NVFP4 without calibrated
    input scales is weight-only, "W4A16_NVFP4"."""
    return {m: "W4A16_NVFP4" if f == "NVFP4" and not calibrated else f for m, f in plan.items()}


def shared_input_groups(plan: dict[str, str | None]) -> list[list[str]]:
    """Groups of NVFP4 projections that read one input (q/k/v of an attention mixer; shared-expert up and
    latent fc1 of an MoE mixer) and so share weight_scale_2 and input amax; a group with a member in
    another format shares nothing."""
    groups: dict[str, list[str]] = {}
    for m in plan:
        hit = _SHARED_INPUT.match(m)
        if hit:
            groups.setdefault(hit.group(1), []).append(m)
    return [g for g in groups.values() if len(g) > 1 and all(plan[m] == "NVFP4" for m in g)]


def group_config(algo: str) -> dict:
    """The compressed-tensors style "config_groups" entry ModelOpt writes for one quant_algo (no targets)."""
    bits = {"FP8": 8, "NVFP4": 4, "W4A16_NVFP4": 4}[algo]
    spec = {"dynamic": False, "num_bits": bits, "type": "float"}
    if algo != "FP8":
        spec["group_size"] = NVFP4_BLOCK
    return {"weights": dict(spec)} if algo == "W4A16_NVFP4" else {"input_activations": dict(spec),
                                                                 "weights": dict(spec)}


def _by_config_module(algos: dict[str, str | None], cfg: NemotronHConfig) -> dict[str, str | None]:
    """{config module: quant_algo or None}: each layer's routed experts as one ".mixer.experts" entry when
    they share one format (else listed one by one), non-linear modules dense."""
    out: dict[str, str | None] = {}
    for module in config_modules(cfg):
        members = [m for m in algos if m == module or m.startswith(module + ".")]
        kinds = {algos[m] for m in members}
        if len(kinds) > 1:
            out.update({m: algos[m] for m in members})
        else:
            out[module] = kinds.pop() if kinds else None
    return out


def summarize_exclude(excluded: list[str], quantized: list[str]) -> list[str]:
    """ModelOpt's exclude_modules summary: each dense module as the shortest prefix wildcard "prefix*"
    (prefix ending before a ".") or "prefix.*" that matches no quantised module, else its own name."""
    negative = {q[:i] + "*" for q in quantized for i in range(len(q) + 1)} | set(quantized)
    out: set[str] = set()
    for name in excluded:
        candidates = [[name[:i] + "*"] if kind == 0 else [name[:i], name[:i] + ".*"]
                      for i, c in enumerate(name) if c == "." for kind in (0, 1)] + [[name]]
        for wildcards in candidates:
            if any(w in negative for w in wildcards):
                continue
            if not all(w in out for w in wildcards):
                out.add(wildcards[-1])
            break
    return sorted(out)


def quant_configs(cfg: NemotronHConfig, algos: dict[str, str | None]) -> tuple[dict, dict]:
    """(hf_quant_config.json content, config.json "quantization_config") describing {module: quant_algo
    or None}, with the fields and module naming of ModelOpt's export."""
    per_module = _by_config_module(algos, cfg)
    used = sorted({a for a in per_module.values() if a})
    if not used:
        raise ValueError("quant_configs: no module is quantised")
    section: dict = {"quant_algo": used[0] if len(used) == 1 else MIXED, "kv_cache_quant_algo": None}
    if section["quant_algo"] == MIXED:
        section["quantized_layers"] = {m: {"quant_algo": a, **({} if a == "FP8" else {"group_size": NVFP4_BLOCK})}
                                       for m, a in per_module.items() if a}
        groups: dict[str, list[str]] = {}
        for m, a in per_module.items():
            if a:
                groups.setdefault(a, []).append(m)
        config_groups = {f"group_{i}": {**group_config(a), "targets": sorted(ms)}
                         for i, (a, ms) in enumerate(groups.items())}
        excluded: list[str] = []
    else:
        if section["quant_algo"] != "FP8":
            section["group_size"] = NVFP4_BLOCK
        excluded = summarize_exclude([m for m, a in per_module.items() if not a],
                                     [m for m, a in per_module.items() if a])
        section["exclude_modules"] = excluded
        config_groups = {"group_0": {**group_config(section["quant_algo"]), "targets": ["Linear"]}}
    qc = {"config_groups": config_groups}
    if "quantized_layers" in section:
        qc["quantized_layers"] = section["quantized_layers"]
    qc.update({"ignore": excluded, "quant_algo": section["quant_algo"], "producer": PRODUCER,
               "quant_method": "modelopt"})
    return {"producer": PRODUCER, "quantization": section}, qc


class ShardWriter:
    """Writes tensors to safetensors shards of at most `max_bytes` each (one model.safetensors when they
    fit, else model-0000i-of-0000n.safetensors and model.safetensors.index.json), holding one shard in memory."""

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if self._pending and self._pending_bytes + array.nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = np.asarray(array, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        self._pending_bytes += array.nbytes
        self._total += array.nbytes

    def _flush(self) -> None:
        save_file(self._pending, str(self.directory / f"shard-{len(self._shards)}.tmp"))
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        """Write the last shard and give the shards their final Hugging Face names."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            (self.directory / "shard-0.tmp").rename(self.directory / SINGLE_FILE)
            return
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.directory / f"shard-{i}.tmp").rename(self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))


def read_config(directory: Path) -> dict:
    """config.json of a checkpoint directory as a dict (CheckpointError when missing or malformed)."""
    return read_json(directory / CONFIG)


def new_output_dir(dst_dir: Path) -> None:
    """Create `dst_dir`, refusing one that holds anything (stale shards would mix with the new ones)."""
    if dst_dir.exists() and any(dst_dir.iterdir()):
        raise CheckpointError(f"output directory {dst_dir} is not empty")
    dst_dir.mkdir(parents=True, exist_ok=True)


def write_side_files(src_dir: Path, dst_dir: Path, config: dict, extra: dict[str, dict]) -> None:
    """Write config.json and the `extra` JSON files; copy every other top-level file that is not a weight
    file or a quantisation config (tokenizer, generation config, ...). Called last, so that a run which
    failed half-way leaves no config.json that would make its output look like a checkpoint."""
    skip = {CONFIG, HF_QUANT_CONFIG, INDEX_FILE}
    for f in sorted(src_dir.iterdir()):
        if f.is_file() and f.name not in skip and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst_dir / f.name)
    for name, content in {CONFIG: config, **extra}.items():
        (dst_dir / name).write_text(json.dumps(content, indent=2) + "\n")


def _input_amax(input_amax: dict | None, plan: dict[str, str | None]) -> dict[str, float] | None:
    """The calibrated input amax of every quantised module, the largest of its group for shared-input
    NVFP4 groups (as ModelOpt's export fuses them); CheckpointError naming a missing or bad entry."""
    if input_amax is None:
        return None
    out = {}
    for m, fmt in plan.items():
        value = input_amax.get(m) if fmt else 0.0
        if fmt and not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
            raise CheckpointError(f"input_amax: module {m} needs a finite amax > 0 (calibration), got {value!r}")
        out[m] = float(value)
    for group in shared_input_groups(plan):
        out.update(dict.fromkeys(group, max(out[m] for m in group)))
    return out


def quantize_checkpoint(src_dir: str | Path, dst_dir: str | Path, algo: str, exclude: list[str] | None = None,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                        input_amax: dict[str, float] | None = None) -> dict[str, str | None]:
    """Write a ModelOpt-format quantised copy of the dense checkpoint in `src_dir` to the new `dst_dir`.

    Linear weights are quantised per `algo` (module docstring) minus the fnmatch `exclude` patterns
    (default ["lm_head"]); every other tensor and config field is copied unchanged. input_amax: {module:
    amax of its input activations} from a calibration run, which adds an input_scale to every quantised
    linear (W8A8 / W4A4 checkpoints); without it NVFP4 is weight-only. Returns the plan
    {module: "NVFP4" | "FP8" | None}.
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    config = read_config(src_dir)
    if "quantization_config" in config or (src_dir / HF_QUANT_CONFIG).exists():
        raise CheckpointError(f"{src_dir} is already quantised; quantize_checkpoint needs a dense checkpoint")
    cfg = NemotronHConfig.from_dict(config)
    src = TensorSource(src_dir)
    plan = plan_modules(algo, linear_modules(cfg), cfg.layer_kinds, exclude)
    if not any(plan.values()):
        raise CheckpointError(f"{src_dir}: recipe {algo} with exclude {exclude} leaves no linear to quantise")
    for module, target in plan.items():
        in_dim = src.shape_of(module + ".weight")[1]
        if target == "NVFP4" and in_dim % NVFP4_BLOCK:
            raise CheckpointError(f"tensor {module}.weight in {src.file_of(module + '.weight')}: input dim {in_dim} "
                                  f"is not divisible by {NVFP4_BLOCK}, so it cannot be NVFP4; exclude it or use FP8")
    amax = _input_amax(input_amax, plan)
    shared = {m: max(nvfp4_global_scale(src.get(g + ".weight", dtypes=DENSE_DTYPES)) for g in group)
              for group in shared_input_groups(plan) for m in group}
    new_output_dir(dst_dir)
    writer = ShardWriter(dst_dir, max_shard_bytes)
    for name in sorted(src.names()):
        module = name.removesuffix(".weight")
        target = plan.get(module) if name.endswith(".weight") else None
        if target is None:
            writer.add(name, src.get(name))
            continue
        tensors = quantize_tensor(name, src.get(name, dtypes=DENSE_DTYPES), target, shared.get(module))
        if amax:
            tensors[".input_scale"] = input_scale(amax[module], target)
        for suffix, array in tensors.items():
            writer.add(module + suffix, array)
    writer.finish()
    hf_quant, quantization_config = quant_configs(cfg, stored_algos(plan, calibrated=amax is not None))
    write_side_files(src_dir, dst_dir, {**config, "quantization_config": quantization_config},
                     {HF_QUANT_CONFIG: hf_quant})
    return plan


def main(argv: list[str] | None = None) -> None:
    """CLI entry: python -m nemoh.io.quantize SRC DST --algo NVFP4 [--exclude PATTERN ...] [--input-amax F]."""
    parser = argparse.ArgumentParser(prog="python -m nemoh.io.quantize", description=__doc__.split("\n")[0])
    parser.add_argument("src", help="dense Hugging Face NemotronH checkpoint directory")
    parser.add_argument("dst", help="new (empty) output directory")
    parser.add_argument("--algo", required=True, choices=ALGOS)
    parser.add_argument("--exclude", nargs="*", default=None,
                        help="fnmatch patterns of modules kept dense (default: lm_head; none given: none)")
    parser.add_argument("--input-amax", default=None,
                        help="JSON {module: amax of its input activations} from a calibration run: writes input_scale")
    args = parser.parse_args(argv)
    amax = read_json(Path(args.input_amax)) if args.input_amax else None
    plan = quantize_checkpoint(args.src, args.dst, args.algo, args.exclude, input_amax=amax)
    counts = {a: sum(v == a for v in plan.values()) for a in ("NVFP4", "FP8", None)}
    print(f"{args.dst}: {counts['NVFP4']} NVFP4, {counts['FP8']} FP8, {counts[None]} dense linear modules"
          f"{', input scales from ' + args.input_amax if amax else ''}")


if __name__ == "__main__":
    main()
