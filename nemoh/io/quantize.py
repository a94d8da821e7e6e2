"""Quantise a dense Hugging Face NemotronH checkpoint into a ModelOpt-format (NVFP4 / FP8) checkpoint.

The tensor formats are those of pallas_kernels.formats (NVIDIA ModelOpt), with the arithmetic of
ModelOpt's weight export (fp32 throughout), so a weight quantised here has the bytes ModelOpt would write:

    NVFP4  weight_scale_2 = amax(|W|) / (6*448)                          float32 scalar
           weight_scale   = fp8_e4m3(max(amax(block16) / (6*weight_scale_2), 2^-9)), 1.0 for an all-zero block
           codes          = e2m1 round-to-nearest-even of W / (weight_scale*weight_scale_2), saturating at 6,
                            sign bit set for every W < 0; two codes a byte, even input index in the low nibble
    FP8    weight_scale   = amax(|W|) / 448;  weight = fp8_e4m3(clip(W / weight_scale, +-448))

No activation calibration is run, so no input_scale (and no KV-cache k_scale / v_scale) is written:
nemoh's kernels are weight-only (W4A16 / W8A16) and never read them. Where ModelOpt would emit NaN (an
all-zero tensor, scale 0) this writes zero codes instead. Recipes (`algo`):
    NVFP4 / FP8          every linear except `exclude` (default ["lm_head"])
    NANO_NVFP4 / NANO_FP8 the official Nano layout: BF16 lm_head, attention q/k/v/o and the in/out_proj of
                         Mamba layers next to an attention layer; the rest NVFP4 / FP8
    MIXED                MIXED_PRECISION: routed experts NVFP4, other projections FP8, attention + lm_head dense
CLI: python -m nemoh.io.quantize SRC DST --algo NVFP4 [--exclude PATTERN ...]
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
from nemoh.io.modelopt import CONFIG, DENSE_DTYPES, HF_QUANT_CONFIG, matches_any
from nemoh.io.tensor_source import INDEX_FILE, SINGLE_FILE, TensorSource
from pallas_kernels.formats import FP8_MAX as _FP8_MAX
from pallas_kernels.formats import NVFP4_BLOCK

FP8_MAX = np.float32(_FP8_MAX)
E2M1_MAX = np.float32(6.0)
ALGOS = ("NVFP4", "FP8", "MIXED", "NANO_NVFP4", "NANO_FP8")
DEFAULT_EXCLUDE = ("lm_head",)
NON_LINEAR_EXCLUDE = ("*conv1d*",)  # written so that readers which treat conv1d as a Linear keep it dense
DEFAULT_SHARD_BYTES = 4 << 30

_LINEAR = re.compile(
    r"^(lm_head"
    r"|.+\.mixer\.(in_proj|out_proj|[qkvo]_proj|up_proj|down_proj|fc1_latent_proj|fc2_latent_proj)"
    r"|.+\.mixer\.(experts\.\d+|shared_experts)\.(up_proj|down_proj))$"
)
_ATTENTION_PROJ = re.compile(r"\.mixer\.[qkvo]_proj$")
_ROUTED_EXPERT = re.compile(r"\.mixer\.experts\.\d+\.(up_proj|down_proj)$")
_BACKBONE_MAMBA_PROJ = re.compile(r"^backbone\.layers\.(\d+)\.mixer\.(in_proj|out_proj)$")


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


def nvfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [out, in] (in % 16 == 0) -> (packed uint8 [out, in/2], weight_scale fp8 [out, in/16],
    weight_scale_2 float32 scalar), computed in float32 with ModelOpt's operation order."""
    w = np.asarray(w, np.float32)
    out_dim, in_dim = w.shape
    blocks = w.reshape(out_dim, in_dim // NVFP4_BLOCK, NVFP4_BLOCK)
    global_scale = np.float32(np.max(np.abs(w), initial=0.0)) / (E2M1_MAX * FP8_MAX)
    block_amax = np.max(np.abs(blocks), axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero tensor gives 0 / 0 = NaN here
        block = block_amax / (E2M1_MAX * global_scale)
    # all-zero block (0) or tensor (NaN) -> 1.0; a tiny block is clamped to the smallest fp8 subnormal, not 0
    block = np.where(block > 0, np.maximum(block, np.float32(2.0**-9)), np.float32(1.0))
    block_fp8 = block.astype(ml_dtypes.float8_e4m3fn)
    denom = block_fp8.astype(np.float32) * global_scale
    scaled = np.divide(blocks, denom[..., None], out=np.zeros_like(blocks), where=denom[..., None] != 0)
    codes = e2m1_encode(scaled.reshape(out_dim, in_dim))
    return pack_nibbles(codes), block_fp8, np.asarray(global_scale, np.float32)


def fp8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [out, in] -> (weight float8_e4m3fn [out, in], weight_scale float32 scalar = amax/448)."""
    w = np.asarray(w, np.float32)
    scale = np.float32(np.max(np.abs(w), initial=0.0)) / FP8_MAX
    scaled = np.divide(w, scale, out=np.zeros_like(w), where=scale != 0)
    data = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return data, np.asarray(scale, np.float32)


def quantize_tensor(name: str, w: np.ndarray, algo: str) -> dict[str, np.ndarray]:
    """One linear's dense ".weight" -> its quantised tensors keyed by suffix (".weight", ".weight_scale", ...)."""
    if not np.all(np.isfinite(w.astype(np.float32))):
        raise CheckpointError(f"tensor {name}: non-finite values cannot be quantised")
    if algo == "FP8":
        data, scale = fp8_quantize(w)
        return {".weight": data, ".weight_scale": scale}
    packed, block, global_scale = nvfp4_quantize(w)
    return {".weight": packed, ".weight_scale": block, ".weight_scale_2": global_scale}


def linear_modules(src: TensorSource) -> list[str]:
    """Sorted names of the checkpoint's linear modules: 2-D ".weight" tensors of the projections nemoh
    quantises (mixer in/out, q/k/v/o, MLP and expert up/down, latent fc1/fc2, lm_head)."""
    return sorted(
        name[: -len(".weight")]
        for name in src.names()
        if name.endswith(".weight") and _LINEAR.match(name[: -len(".weight")]) and len(src.shape_of(name)) == 2
    )


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
    if algo == "MIXED" or algo.startswith("NANO_"):
        kept |= {m for m in modules if _ATTENTION_PROJ.search(m)}
    if algo.startswith("NANO_"):
        kept |= _nano_adjacent_mamba(modules, layer_kinds)
    if algo == "MIXED":
        return {m: None if m in kept else ("NVFP4" if _ROUTED_EXPERT.search(m) else "FP8") for m in modules}
    return {m: None if m in kept else algo.removeprefix("NANO_") for m in modules}


def quant_configs(algo: str, plan: dict[str, str | None], exclude: list[str] | None) -> tuple[dict, dict]:
    """(hf_quant_config.json content, config.json "quantization_config") describing `plan`."""
    patterns = set(DEFAULT_EXCLUDE if exclude is None else exclude) | set(NON_LINEAR_EXCLUDE)
    excluded = sorted(patterns | {m for m, a in plan.items() if a is None})
    section: dict = {"quant_algo": None, "kv_cache_quant_algo": None, "exclude_modules": excluded}
    if algo == "MIXED":
        section["quant_algo"] = "MIXED_PRECISION"
        section["quantized_layers"] = {
            m: {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK} if a == "NVFP4" else {"quant_algo": "FP8"}
            for m, a in sorted(plan.items()) if a is not None
        }
    else:
        section["quant_algo"] = algo.removeprefix("NANO_")
        if section["quant_algo"] == "NVFP4":
            section["group_size"] = NVFP4_BLOCK
    hf_quant = {"producer": {"name": "nemoh.io.quantize"}, "quantization": section}
    qc = {"quant_method": "modelopt", "quant_algo": section["quant_algo"], "ignore": excluded, "kv_cache_scheme": None}
    for key in ("group_size", "quantized_layers"):
        if key in section:
            qc[key] = section[key]
    return hf_quant, qc


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
    path = directory / CONFIG
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the model config ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return raw


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


def quantize_checkpoint(src_dir: str | Path, dst_dir: str | Path, algo: str, exclude: list[str] | None = None,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, str | None]:
    """Write a ModelOpt-format quantised copy of the dense checkpoint in `src_dir` to the new `dst_dir`.

    Linear weights are quantised per `algo` (module docstring) minus the fnmatch `exclude` patterns
    (default ["lm_head"]); every other tensor and config field is copied unchanged. Returns the plan
    {module: "NVFP4" | "FP8" | None}.
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    config = read_config(src_dir)
    if "quantization_config" in config or (src_dir / HF_QUANT_CONFIG).exists():
        raise CheckpointError(f"{src_dir} is already quantised; quantize_checkpoint needs a dense checkpoint")
    layer_kinds = NemotronHConfig.from_dict(config).layer_kinds
    src = TensorSource(src_dir)
    plan = plan_modules(algo, linear_modules(src), layer_kinds, exclude)
    for module, target in plan.items():
        in_dim = src.shape_of(module + ".weight")[1]
        if target == "NVFP4" and in_dim % NVFP4_BLOCK:
            raise CheckpointError(f"tensor {module}.weight in {src.file_of(module + '.weight')}: input dim {in_dim} "
                                  f"is not divisible by {NVFP4_BLOCK}, so it cannot be NVFP4; exclude it or use FP8")
    new_output_dir(dst_dir)
    writer = ShardWriter(dst_dir, max_shard_bytes)
    for name in sorted(src.names()):
        module = name.removesuffix(".weight")
        target = plan.get(module) if name.endswith(".weight") else None
        if target is None:
            writer.add(name, src.get(name))
            continue
        for suffix, array in quantize_tensor(name, src.get(name, dtypes=DENSE_DTYPES), target).items():
            writer.add(module + suffix, array)
    writer.finish()
    hf_quant, quantization_config = quant_configs(algo, plan, exclude)
    write_side_files(src_dir, dst_dir, {**config, "quantization_config": quantization_config},
                     {HF_QUANT_CONFIG: hf_quant})
    return plan


def main(argv: list[str] | None = None) -> None:
    """CLI entry: python -m nemoh.io.quantize SRC DST --algo NVFP4 [--exclude PATTERN ...]."""
    parser = argparse.ArgumentParser(prog="python -m nemoh.io.quantize", description=__doc__.split("\n")[0])
    parser.add_argument("src", help="dense Hugging Face NemotronH checkpoint directory")
    parser.add_argument("dst", help="new (empty) output directory")
    parser.add_argument("--algo", required=True, choices=ALGOS)
    parser.add_argument("--exclude", nargs="*", default=None,
                        help="fnmatch patterns of modules kept dense (default: lm_head; none given: none)")
    args = parser.parse_args(argv)
    plan = quantize_checkpoint(args.src, args.dst, args.algo, args.exclude)
    counts = {a: sum(v == a for v in plan.values()) for a in ("NVFP4", "FP8", None)}
    print(f"{args.dst}: {counts['NVFP4']} NVFP4, {counts['FP8']} FP8, {counts[None]} dense linear modules")


if __name__ == "__main__":
    main()
