"""Tiny NemotronH configs (config.json fields) for oracle tests, and `build_all` to make them.

Across the set they cover: every layer kind (all_kinds has M, *, -, E); Mamba n_groups > 1;
grouped MoE routing (n_group > 1, topk_group < n_group); norm_topk_prob False; conv_kernel 3 and 5;
chunk_size 8 and 16 (test prompts are longer than, and not a multiple of, the chunk); latent MoE;
both layout spellings; GQA and MHA; eos_token_id as an int and as a list. Each is small enough that
transformers builds and runs it in milliseconds on CPU.
"""

from __future__ import annotations

from pathlib import Path

from nemoh.oracle import make_checkpoints

# time_step_min tiny: transformers' full-sequence Mamba path clamps dt there (see hf_worker).
_COMMON = {
    "time_step_min": 1e-7, "time_step_floor": 1e-4, "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False, "use_conv_bias": True, "mamba_hidden_act": "silu",
    "mlp_hidden_act": "relu2", "pad_token_id": 0, "bos_token_id": 1,
}

# Widths every quantised layout takes (each quantised matrix's input a multiple of 16, which all_kinds'
# 24-wide shared expert is not): for benchmark tests that build NVFP4 models without the oracle.
QUANTISABLE_WIDTHS = dict(vocab_size=64, hidden_size=64, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                          n_groups=2, conv_kernel=4, chunk_size=8, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          moe_shared_expert_intermediate_size=32, eos_token_id=2)

CONFIGS: dict[str, dict] = {
    # Every layer kind; Nano-like MoE (one routing group, normalised top-k, scaling 2.5).
    "all_kinds": {
        **_COMMON, "vocab_size": 256, "hidden_size": 32, "hybrid_override_pattern": "M*EM-E*M",
        "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2,
        "conv_kernel": 4, "chunk_size": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 48,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 24, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "eos_token_id": 3,
    },
    # Grouped routing (4 groups of 2, keep 2), unnormalised top-3; conv_kernel 3; n_groups 4.
    "grouped_routing": {
        **_COMMON, "vocab_size": 128, "hidden_size": 48,
        "layers_block_type": ["linear_attention", "moe", "linear_attention", "full_attention", "moe", "moe"],
        "mamba_num_heads": 8, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 4,
        "conv_kernel": 3, "chunk_size": 16,
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
        "moe_shared_expert_intermediate_size": 16, "n_group": 4, "topk_group": 2,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "eos_token_id": 2,
    },
    # Latent MoE (experts read 16 wide); conv_kernel 5; grouped routing 2 groups, keep 1.
    "latent_moe": {
        **_COMMON, "vocab_size": 192, "hidden_size": 64, "hybrid_override_pattern": "ME*EME",
        "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 2,
        "conv_kernel": 5, "chunk_size": 16,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32, "moe_latent_size": 16, "n_group": 2, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.0,
        "eos_token_id": 5,
    },
    # Dense Nemotron-H style (no MoE): one Mamba group, MHA, eos as a list.
    "dense": {
        **_COMMON, "vocab_size": 320, "hidden_size": 40,
        "layers_block_type": ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
                              "linear_attention", "mlp"],
        "mamba_num_heads": 5, "mamba_head_dim": 8, "ssm_state_size": 12, "n_groups": 1,
        "conv_kernel": 4, "chunk_size": 8,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 80,
        "eos_token_id": [2, 7],
    },
}


def layout_spelling(config: dict) -> str:
    """The spelling a config uses: "pattern" (hybrid_override_pattern) or "list" (layers_block_type)."""
    return "pattern" if "hybrid_override_pattern" in config else "list"


def build_all(root: Path) -> dict[str, Path]:
    """Make every CONFIGS entry as a float32 checkpoint under root/<name>, in ONE worker call, each
    written in its own layout spelling. Returns name -> checkpoint directory."""
    specs = [{"name": name, "config": cfg, "out_dir": Path(root) / name, "seed": i, "dtype": "float32",
              "layout_spelling": layout_spelling(cfg)} for i, (name, cfg) in enumerate(CONFIGS.items())]
    return dict(zip(CONFIGS, make_checkpoints(specs)))
