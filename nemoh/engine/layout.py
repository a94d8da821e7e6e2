"""The static shapes a request compiles to, rounded up to a few buckets so that requests of other
sizes reuse the same compiled programs, and checked against free device memory before any work.

Buckets (powers of two with a minimum): batch slots 1 for a single prompt, else 16, 32, 64, ... (rows
past the prompts are finished dummy rows, which MoE layers route to no expert); per-row capacity
(longest prompt + max_new_tokens) 1024, 2048, ... tokens; stop-id slots 8, 16, ...  The prefill chunk
width is min(prefill_chunk, row capacity); by default on a GPU it follows the batch slots (chunk_width),
so a chunk holds about CHUNK_TOKENS tokens across the batch. Sampling settings, the number of prompt
chunks and the number of decode steps are runtime values.
"""

from __future__ import annotations

import dataclasses

from nemoh.config import NemotronHConfig
from nemoh.engine.carry import StateCosts
from nemoh.engine.kv_pages import CacheSpec, pages_for, pool_sizes
from nemoh.engine.memory import free_bytes, request_bytes
from nemoh.errors import CacheCapacityError

MIN_ROWS = 16
MIN_ROW_TOKENS = 1024
MAX_ROW_TOKENS = 2**30  # positions stay well inside int32
MIN_STOP_SLOTS = 8
CHUNK_TOKENS = 2048  # default prefill chunk, summed over the batch slots
MIN_CHUNK = 256  # default prefill chunk per row, at least


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum) (minimum a power of two)."""
    return max(minimum, 1 << (n - 1).bit_length())


def chunk_width(rows: int, platform: str) -> int:
    """The default prefill chunk for `rows` batch slots on a device of `platform`. On a GPU each chunk
    reads every weight once (for MoE, every expert some token picks), so wide chunks amortise the weight
    reads: CHUNK_TOKENS / rows, at least MIN_CHUNK (2048 tokens keep a single prompt's activations and
    attention scores small). Elsewhere (CPU) compute dominates and padding costs: MIN_CHUNK."""
    return max(MIN_CHUNK, CHUNK_TOKENS // rows) if platform == "gpu" else MIN_CHUNK


def row_bucket(n: int) -> int:
    """Batch slots for n prompts: exactly 1 for one prompt (single-stream decode pays for no dummy
    rows), else bucket(n, MIN_ROWS)."""
    return 1 if n == 1 else bucket(n, MIN_ROWS)


@dataclasses.dataclass(frozen=True)
class Layout:
    """rows: batch slots; chunk: prefill chunk width; row_tokens: per-row capacity, a multiple of chunk;
    pages_per_row: block-table width; num_pages: KV pool size; stop_slots: stop-id table width; shards:
    the batch shards of a mesh (rows and pool split into that many equal parts, see kv_pages)."""

    rows: int
    chunk: int
    row_tokens: int
    page_size: int
    pages_per_row: int
    num_pages: int
    stop_slots: int
    shards: int = 1


def plan(cfg: NemotronHConfig, costs: StateCosts, lengths: list[int], max_new_tokens: int, cache: CacheSpec,
         prefill_chunk: int | None, num_stops: int, device, shards: int = 1) -> Layout:
    """The layout of a request of prompts of `lengths` for a model whose carried states cost `costs`:
    the bucketed pool when it fits `device`'s free memory, else the exact one; CacheCapacityError (need
    and free memory) when neither fits. prefill_chunk: tokens per row per prefill chunk (None:
    chunk_width of the batch slots on `device`). shards: the batch shards of a mesh (batch slots rounded
    up to a multiple of it)."""
    budgets = [n + max_new_tokens for n in lengths]
    capacity = bucket(max(budgets), MIN_ROW_TOKENS)
    rows = -(-row_bucket(len(lengths)) // shards) * shards
    chunk = min(prefill_chunk or chunk_width(rows, device.platform), capacity)
    row_tokens = -(-capacity // chunk) * chunk
    pages_per_row = pages_for(row_tokens, cache.page_size)
    free, source = free_bytes(device)
    for num_pages in pool_sizes(costs.per_page, cache, budgets, rows * pages_per_row, rows, shards):
        lay = Layout(rows, chunk, row_tokens, cache.page_size, pages_per_row, num_pages,
                     bucket(num_stops, MIN_STOP_SLOTS), shards)
        need = request_bytes(cfg, costs, lay)
        if sum(need.values()) <= free:
            return lay
    parts = ", ".join(f"{k} {v:.3g}" for k, v in need.items())
    raise CacheCapacityError(
        f"the request ({len(lengths)} prompt(s), longest {max(lengths)} token(s), max_new_tokens={max_new_tokens}) "
        f"needs about {sum(need.values()):.3g} bytes of device memory ({parts}), but only {free:.3g} bytes are "
        f"free ({source})"
    )
