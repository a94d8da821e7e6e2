"""nemoh info DIR: what a checkpoint holds, read from its JSON files and safetensors headers only.

No tensor data is read and nothing is put on a device. Parameters are logical weights (an NVFP4 byte
holds two); scale tensors count as bytes, not parameters.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

import numpy as np

from nemoh.config import NemotronHConfig
from nemoh.errors import CheckpointError
from nemoh.io.modelopt import QuantSpec
from nemoh.io.quantize import linear_modules
from nemoh.io.tensor_source import SAFETENSORS_DTYPES, TensorSource
from nemoh.text.tokenizer import TOKENIZER_FILE, load_tokenizer

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")
_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclasses.dataclass(frozen=True)
class Totals:
    tensors: int = 0
    params: int = 0
    bytes: int = 0

    def __add__(self, other: "Totals") -> "Totals":
        return Totals(self.tensors + other.tensors, self.params + other.params, self.bytes + other.bytes)


@dataclasses.dataclass(frozen=True)
class CheckpointSummary:
    """config; by_kind: {embedding | lm_head | final_norm | mamba | attention | mlp | moe | mtp: Totals};
    groups: {module group (e.g. "moe.experts.*.up_proj"): {format (NVFP4, FP8, BF16, ...): modules}};
    quant: QuantSpec or None; tokenizer: a one-line description."""

    config: NemotronHConfig
    by_kind: dict[str, Totals]
    groups: dict[str, dict[str, int]]
    quant: QuantSpec | None
    tokenizer: str

    @property
    def total(self) -> Totals:
        return sum(self.by_kind.values(), Totals())

    @property
    def quantisation(self) -> str:
        if self.quant is None:
            return "none"
        kv = f", KV cache {self.quant.kv_cache_quant_algo}" if self.quant.kv_cache_quant_algo else ""
        return f"{self.quant.quant_algo or 'weights dense'}{kv} (from {Path(self.quant.source).name})"


def tensor_kind(name: str, cfg: NemotronHConfig) -> str:
    """Which part of the model a tensor belongs to."""
    if name.startswith("mtp."):
        return "mtp"
    if name == "lm_head.weight":
        return "lm_head"
    if name.startswith("backbone.embedding"):
        return "embedding"
    hit = _LAYER.match(name)
    if hit and int(hit.group(1)) < cfg.num_layers:
        return cfg.layer_kinds[int(hit.group(1))]
    return "final_norm" if name.startswith("backbone.norm_f") else "other"


def module_group(module: str, cfg: NemotronHConfig) -> str:
    """backbone.layers.3.mixer.experts.7.up_proj -> moe.experts.*.up_proj; lm_head -> lm_head."""
    hit = _LAYER.match(module)
    if not hit:
        return module
    rest = _EXPERT.sub(".experts.*.", hit.group(2)).removeprefix("mixer.")
    return f"{tensor_kind(module + '.weight', cfg)}.{rest}"


def _tensor_totals(src: TensorSource, name: str) -> Totals:
    shape, dtype = src.shape_of(name), src.dtype_of(name)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * np.dtype(SAFETENSORS_DTYPES.get(dtype, np.uint8)).itemsize
    if name.endswith(SCALE_SUFFIXES):
        params = 0
    elif dtype == "U8" and name.endswith(".weight"):  # NVFP4: two 4-bit weights a byte
        params = 2 * count
    else:
        params = count
    return Totals(1, params, nbytes)


def _tokenizer_line(path: Path) -> str:
    if not (path / TOKENIZER_FILE).is_file():
        return "none (token ids only)"
    tok = load_tokenizer(path)
    chat = "with" if tok.chat_template is not None else "without"
    return f"{TOKENIZER_FILE}, vocab {tok.vocab_size}, {chat} a chat template"


def summarise(path: str | Path) -> CheckpointSummary:
    """Read the config, the quantisation config and every safetensors header of a checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    cfg = NemotronHConfig.from_json_file(path / "config.json")
    src = TensorSource(path)
    spec = QuantSpec.from_dir(path)
    by_kind: dict[str, Totals] = collections.defaultdict(Totals)
    for name in src.names():
        by_kind[tensor_kind(name, cfg)] += _tensor_totals(src, name)
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for module in linear_modules(cfg):
        fmt = (spec.algo_for(module) if spec else None) or src.dtype_of(module + ".weight")
        groups[module_group(module, cfg)][fmt] += 1
    return CheckpointSummary(cfg, dict(by_kind), {g: dict(c) for g, c in groups.items()}, spec,
                             _tokenizer_line(path))


def _config_lines(cfg: NemotronHConfig) -> list[tuple[str, str]]:
    counts = ", ".join(f"{k} {len(cfg.layers_of(k))}" for k in ("mamba", "attention", "mlp", "moe") if cfg.layers_of(k))
    rows = [("layers", f"{cfg.num_layers}: {cfg.pattern} ({counts})"),
            ("sizes", f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
                      f"{'tied' if cfg.tie_word_embeddings else 'untied'} lm_head, eos {list(cfg.eos_token_ids)}")]
    if cfg.layers_of("mamba"):
        rows.append(("mamba", f"{cfg.mamba_num_heads} heads x {cfg.mamba_head_dim}, state {cfg.ssm_state_size}, "
                              f"{cfg.n_groups} groups, conv {cfg.conv_kernel}, chunk {cfg.chunk_size}"))
    if cfg.layers_of("attention"):
        rows.append(("attention", f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads "
                                  f"of {cfg.head_dim}"))
    if cfg.layers_of("mlp"):
        rows.append(("mlp", f"relu2, width {cfg.intermediate_size}"))
    if cfg.layers_of("moe"):
        shared = f"shared {cfg.moe_shared_expert_intermediate_size}" if cfg.n_shared_experts else "no shared expert"
        latent = f", latent {cfg.moe_latent_size}" if cfg.moe_latent_size else ""
        rows.append(("moe", f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, width "
                            f"{cfg.moe_intermediate_size}, {shared}{latent}; groups {cfg.n_group} keep "
                            f"{cfg.topk_group}, scaling {cfg.routed_scaling_factor}"))
    return rows


def format_summary(path: str | Path, s: CheckpointSummary) -> str:
    """The text `nemoh info` prints."""
    rows = [("checkpoint", str(path)), *_config_lines(s.config), ("quantisation", s.quantisation),
            ("tokenizer", s.tokenizer)]
    lines = [f"{k:<13} {v}" for k, v in rows]
    lines += ["", f"{'kind':<13} {'tensors':>8} {'params':>14} {'bytes':>14}"]
    for kind, t in [*sorted(s.by_kind.items()), ("total", s.total)]:
        lines.append(f"{kind:<13} {t.tensors:>8} {t.params:>14,} {t.bytes:>14,}")
    width = max([len("module group")] + [len(g) for g in s.groups])
    lines += ["", f"{'module group':<{width}}  format (modules)"]
    for group, formats in sorted(s.groups.items()):
        lines.append(f"{group:<{width}}  " + ", ".join(f"{f} ({n})" for f, n in sorted(formats.items())))
    return "\n".join(lines)


def add_parser(sub, formatter) -> None:
    p = sub.add_parser("info", help="describe a checkpoint without loading its weights",
                       description="Print the config summary, layer pattern, parameter and byte counts by kind, "
                                   "and the quantisation of each module group. Reads only JSON files and "
                                   "safetensors headers.", formatter_class=formatter)
    p.add_argument("model", metavar="DIR", help="checkpoint directory (Hugging Face layout)")
    p.set_defaults(run=run)


def run(args) -> int:
    print(format_summary(args.model, summarise(args.model)))
    return 0
