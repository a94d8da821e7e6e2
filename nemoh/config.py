"""NemotronHConfig: the static, frozen description of a NemotronH model, parsed from config.json.

Both layer-layout spellings are accepted: the `hybrid_override_pattern` string (one character per
layer: M mamba, * attention, - dense MLP, E MoE) and the `layers_block_type` list (words
mamba/linear_attention, attention/full_attention, mlp, moe). Legacy key aliases (mamba_n_groups, ...)
are mapped onto their current names. Inconsistent sizes raise ConfigError naming field and value.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from nemoh.errors import ConfigError
from nemoh.io.json_file import read_json

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
LAYER_KINDS = (MAMBA, ATTENTION, MLP, MOE)

_PATTERN_CHARS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_BLOCK_WORDS = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}
# config.json keys that describe a stored checkpoint or its layout, not the model: never carried over
_NOT_CARRIED = ("quantization_config", "hybrid_override_pattern", "layers_block_type", "layer_types",
                "num_hidden_layers", "eos_token_id", "model_type", "architectures")
# legacy name -> current name
_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_chunk_size": "chunk_size",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_limit": "time_step_limit",
    "attention_head_dim": "head_dim",
    "mamba_expand": "expand",
}


@dataclasses.dataclass(frozen=True)
class NemotronHConfig:
    """Sizes and options of one NemotronH model. Hashable, so it can be static in jit."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]
    layer_norm_epsilon: float = 1e-5
    # Mamba2
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # attention
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    # dense MLP
    intermediate_size: int = 0
    mlp_bias: bool = False
    # MoE
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    n_shared_experts: int = 1
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # tokens
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    # config.json fields nemoh does not use, as (key, JSON text), kept so a saved checkpoint keeps them;
    # left out of equality and hashing, so they never cause a recompile
    hf_extra: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def pattern(self) -> str:
        inverse = {v: k for k, v in _PATTERN_CHARS.items()}
        return "".join(inverse[k] for k in self.layer_kinds)

    @property
    def mamba_intermediate(self) -> int:
        """I = nh * hd: width of x, z and the gated norm."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: x, B and C."""
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:
        return 2 * self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size + self.mamba_num_heads

    @property
    def moe_input_size(self) -> int:
        """Width the routed experts read: the latent size when latent MoE is on, else hidden."""
        return self.moe_latent_size or self.hidden_size

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "NemotronHConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        d = dict(raw)
        for old, new in _ALIASES.items():
            if old in d:
                if new in d and d[new] != d[old]:
                    raise ConfigError(f"config gives both {old}={d[old]!r} and {new}={d[new]!r}")
                d[new] = d.pop(old)
        kinds = _parse_layer_kinds(d)
        if "num_hidden_layers" in d and d["num_hidden_layers"] is not None and "hybrid_override_pattern" in d:
            if int(d["num_hidden_layers"]) != len(kinds):
                raise ConfigError(
                    f"num_hidden_layers={d['num_hidden_layers']} but hybrid_override_pattern has {len(kinds)} layers"
                )
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        limit = d.get("time_step_limit", (0.0, math.inf))
        if not (isinstance(limit, (list, tuple)) and len(limit) == 2):
            raise ConfigError(f"time_step_limit must be a pair [min, max], got {limit!r}")
        limit = tuple(_json_float(v, "time_step_limit") for v in limit)

        kwargs: dict[str, Any] = {"layer_kinds": kinds, "eos_token_ids": eos_ids,
                                  "time_step_limit": (float(limit[0]), float(limit[1]))}
        for f in dataclasses.fields(cls):
            if f.name in kwargs or f.name not in d or f.name == "hf_extra":
                continue
            kwargs[f.name] = d[f.name]
        kwargs["hf_extra"] = tuple(sorted((k, json.dumps(v)) for k, v in d.items()
                                          if k not in kwargs and k not in _NOT_CARRIED))
        if d.get("use_bias") or d.get("mamba_proj_bias"):
            raise ConfigError(f"use_bias={d.get('use_bias')!r}, mamba_proj_bias={d.get('mamba_proj_bias')!r}: "
                              "Mamba projection biases are not part of NemotronH and are not supported")
        for required in ("vocab_size", "hidden_size"):
            if required not in kwargs:
                raise ConfigError(f"config is missing required field {required!r}")
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers' NemotronHForCausalLM reads (pattern spelling), with every field
        of the config this was parsed from that nemoh does not use."""
        d: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        d.update(model_type="nemotron_h", architectures=["NemotronHForCausalLM"],
                 hybrid_override_pattern=self.pattern, num_hidden_layers=self.num_layers)
        for f in dataclasses.fields(self):
            if f.name not in ("layer_kinds", "eos_token_ids", "time_step_limit", "hf_extra"):
                d[f.name] = getattr(self, f.name)
        eos = list(self.eos_token_ids)
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        d["time_step_limit"] = [v if math.isfinite(v) else {"__float__": "Infinity"} for v in self.time_step_limit]
        return d

    @classmethod
    def from_json_file(cls, path: str | Path) -> "NemotronHConfig":
        return cls.from_dict(read_json(path, ConfigError))

    def validate(self) -> None:
        """Raise ConfigError on any size that the model cannot be built with."""

        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{field}={getattr(self, field)!r}: {msg}")

        for field in ("vocab_size", "hidden_size"):
            need(_is_pos_int(getattr(self, field)), field, "must be a positive integer")
        need(self.layer_norm_epsilon > 0, "layer_norm_epsilon", "must be > 0")
        if MAMBA in self.layer_kinds:
            for field in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                          "chunk_size"):
                need(_is_pos_int(getattr(self, field)), field, "must be a positive integer")
            need(self.mamba_num_heads % self.n_groups == 0, "n_groups",
                 f"mamba_num_heads={self.mamba_num_heads} is not divisible by n_groups")
            need(self.time_step_limit[0] <= self.time_step_limit[1], "time_step_limit", "min exceeds max")
        if ATTENTION in self.layer_kinds:
            for field in ("num_attention_heads", "num_key_value_heads", "head_dim"):
                need(_is_pos_int(getattr(self, field)), field, "must be a positive integer")
            need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"num_attention_heads={self.num_attention_heads} is not divisible by num_key_value_heads")
            need(not self.attention_bias, "attention_bias", "attention biases are not part of NemotronH")
        if MLP in self.layer_kinds:
            need(_is_pos_int(self.intermediate_size), "intermediate_size", "must be a positive integer")
            need(not self.mlp_bias, "mlp_bias", "MLP biases are not supported")
        if MOE in self.layer_kinds:
            for field in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                          "topk_group"):
                need(_is_pos_int(getattr(self, field)), field, "must be a positive integer")
            need(self.n_routed_experts % self.n_group == 0, "n_group",
                 f"n_routed_experts={self.n_routed_experts} is not divisible by n_group")
            need(self.topk_group <= self.n_group, "topk_group", f"exceeds n_group={self.n_group}")
            experts_in_groups = self.topk_group * (self.n_routed_experts // self.n_group)
            need(self.num_experts_per_tok <= experts_in_groups, "num_experts_per_tok",
                 f"exceeds the {experts_in_groups} experts in the topk_group={self.topk_group} kept groups")
            need(self.n_routed_experts // self.n_group >= 2 or self.n_group == 1, "n_group",
                 "group scores need at least 2 experts per group")
            need(self.n_shared_experts in (0, 1), "n_shared_experts", "must be 0 or 1")
            if self.n_shared_experts:
                need(_is_pos_int(self.moe_shared_expert_intermediate_size), "moe_shared_expert_intermediate_size",
                     "must be a positive integer")
            if self.moe_latent_size is not None:
                need(_is_pos_int(self.moe_latent_size), "moe_latent_size", "must be a positive integer or null")
        for e in self.eos_token_ids:
            if not 0 <= e < self.vocab_size:
                raise ConfigError(f"eos_token_id={e} is outside the vocabulary of {self.vocab_size}")


def _json_float(v: Any, field: str) -> float:
    """A number from config.json; transformers writes infinities as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{field}: {v!r} is not a number") from None


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _parse_layer_kinds(d: dict[str, Any]) -> tuple[str, ...]:
    pattern = d.get("hybrid_override_pattern")
    blocks = d.get("layers_block_type", d.get("layer_types"))
    if pattern is None and blocks is None:
        raise ConfigError("config has neither hybrid_override_pattern nor layers_block_type")
    kinds_from_pattern = kinds_from_blocks = None
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"hybrid_override_pattern must be a non-empty string, got {pattern!r}")
        bad = [(i, c) for i, c in enumerate(pattern) if c not in _PATTERN_CHARS]
        if bad:
            i, c = bad[0]
            raise ConfigError(
                f"hybrid_override_pattern={pattern!r}: unknown layer kind {c!r} at layer {i} "
                f"(known: {''.join(_PATTERN_CHARS)})"
            )
        kinds_from_pattern = tuple(_PATTERN_CHARS[c] for c in pattern)
    if blocks is not None:
        if not isinstance(blocks, list) or not blocks:
            raise ConfigError(f"layers_block_type must be a non-empty list, got {blocks!r}")
        out = []
        for i, w in enumerate(blocks):
            if w not in _BLOCK_WORDS:
                raise ConfigError(
                    f"layers_block_type: unknown layer kind {w!r} at layer {i} (known: {sorted(_BLOCK_WORDS)})"
                )
            out.append(_BLOCK_WORDS[w])
        kinds_from_blocks = tuple(out)
    if kinds_from_pattern and kinds_from_blocks and kinds_from_pattern != kinds_from_blocks:
        raise ConfigError(
            f"hybrid_override_pattern={pattern!r} disagrees with layers_block_type={blocks!r}"
        )
    return kinds_from_blocks or kinds_from_pattern
