"""Regenerate checkpoints/tiny-nemotron-h: a ~0.6 MB random-weight NemotronH made by HF transformers.

Run from the repo root after `bash scripts/setup.sh && bash scripts/setup_oracle.sh`:

    .venv/bin/python checkpoints/make_tiny.py

Weights are random (see nemoh/oracle/hf_worker.py for the distributions): the tokens it generates
mean nothing. It exists so the CLI, loader and engine can be exercised without a download.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from nemoh.oracle import make_checkpoints

OUT_DIR = Path(__file__).resolve().parent / "tiny-nemotron-h"
SEED = 0
DTYPE = "bfloat16"
# Nano-shaped (all four layer kinds, one routing group, scaling 2.5) at toy sizes. time_step_min is
# tiny so that transformers' full-sequence dt clamp never fires (see hf_worker).
CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "hybrid_override_pattern": "M*EM-EME",
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
    "conv_kernel": 4, "chunk_size": 16, "use_conv_bias": True, "mamba_hidden_act": "silu",
    "time_step_min": 1e-7, "time_step_floor": 1e-4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "mlp_hidden_act": "relu2",
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 64, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1,
}


def main() -> None:
    if OUT_DIR.exists():
        shutil.rmtree(OUT_DIR)
    (path,) = make_checkpoints([{"name": "tiny-nemotron-h", "config": CONFIG, "out_dir": OUT_DIR,
                                 "seed": SEED, "dtype": DTYPE, "layout_spelling": "pattern"}])
    print(f"wrote {path}: " + ", ".join(f"{p.name} {p.stat().st_size} B" for p in sorted(path.iterdir())))


if __name__ == "__main__":
    main()
