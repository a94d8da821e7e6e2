"""Device memory a request needs (KV pool + carry + activations, estimated from its shapes) and the
memory that is free, so that a request too big for the device is refused before any work."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from nemoh.config import NemotronHConfig

if TYPE_CHECKING:
    from nemoh.engine.carry import StateCosts
    from nemoh.engine.layout import Layout

F32 = 4


def free_bytes(device) -> tuple[int, str]:
    """(free bytes, where the figure comes from): the allocator's limit minus what is in use where the
    device reports memory_stats() (GPU), else the host's available memory (CPU). On a GPU the limit is
    a fraction of the card (JAX's default .75, preallocating or not), which the source text names: a
    bf16 Nano (63 GB) leaves 0.5 GB of an 80 GB card's default limit free."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        limit, used = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        return limit - used, (f"{device} memory_stats: {used:.3g} of the allocator's {limit:.3g} bytes in use; "
                              "XLA_PYTHON_CLIENT_MEM_FRACTION sets that limit, .75 of the card by default")
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024, f"{device}: host MemAvailable"
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), f"{device}: host free pages"


def request_bytes(cfg: NemotronHConfig, costs: StateCosts, lay: Layout) -> dict[str, int]:
    """Bytes by part: the KV pool; the carry (the layers' states, token and block tables, logits); and
    the activations of the largest program, a prefill chunk of rows x chunk tokens: one layer's widest
    intermediates (4 live fp32 buffers), the SSD's chunked terms (when a layer carries a per-row state),
    attention scores over the row capacity (when layers hold KV pages), and the logits with the
    sampler's fp32 working copies."""
    rows, chunk, row_tokens = lay.rows, lay.chunk, lay.row_tokens
    carry = rows * (costs.per_row + (row_tokens + lay.pages_per_row) * 4 + cfg.vocab_size * F32)
    tokens = rows * chunk
    width = max(cfg.hidden_size, cfg.in_proj_dim, cfg.intermediate_size,
                cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.moe_shared_expert_intermediate_size)
    Q, nh = cfg.chunk_size, cfg.mamba_num_heads
    ssd = tokens * nh * (Q + cfg.mamba_head_dim * cfg.ssm_state_size // Q) * F32 if costs.per_row else 0
    attention = rows * row_tokens * F32 * (2 * cfg.num_attention_heads * chunk
                                           + 2 * cfg.num_key_value_heads * cfg.head_dim) if costs.per_page else 0
    activations = 4 * tokens * width * F32 + ssd + attention + 4 * rows * cfg.vocab_size * F32
    return {"KV pool": lay.num_pages * costs.per_page, "carry": carry, "activations": activations}
