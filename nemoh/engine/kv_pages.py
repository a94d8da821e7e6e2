"""KV page pool sizing and allocation: explicit, checked, never silently shrunk."""

from __future__ import annotations

import dataclasses

import numpy as np

from nemoh.config import ATTENTION, NemotronHConfig
from nemoh.errors import CacheCapacityError, RequestError


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """How big the KV pool is: `num_pages` pages, or as many as fit `memory_budget_bytes` (over all
    attention layers, K and V), or (both None) exactly what the request needs."""

    page_size: int = 16
    num_pages: int | None = None
    memory_budget_bytes: int | None = None

    def __post_init__(self):
        if not (isinstance(self.page_size, int) and self.page_size >= 1):
            raise RequestError(f"page_size={self.page_size!r}: must be an integer >= 1")
        if self.num_pages is not None and self.memory_budget_bytes is not None:
            raise RequestError("give num_pages or memory_budget_bytes, not both")
        if self.num_pages is not None and not (isinstance(self.num_pages, int) and self.num_pages >= 1):
            raise RequestError(f"num_pages={self.num_pages!r}: must be an integer >= 1")


def page_bytes(cfg: NemotronHConfig, page_size: int, itemsize: int) -> int:
    """Bytes one page costs across every attention layer (K and V)."""
    return 2 * len(cfg.layers_of(ATTENTION)) * page_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


def allocate(cfg: NemotronHConfig, spec: CacheSpec, token_budgets: list[int], itemsize: int
             ) -> tuple[int, np.ndarray]:
    """Give each sequence contiguous pages for `token_budgets[i]` tokens (prompt + new tokens).

    Returns (num_pages in the pool, block_tables [B, P] int32). Raises CacheCapacityError, naming
    the need and the capacity, before any device work when the request does not fit.
    """
    need = [-(-t // spec.page_size) for t in token_budgets]
    total = sum(need)
    if spec.num_pages is not None:
        capacity, source = spec.num_pages, f"num_pages={spec.num_pages}"
    elif spec.memory_budget_bytes is not None:
        per_page = max(page_bytes(cfg, spec.page_size, itemsize), 1)
        capacity = spec.memory_budget_bytes // per_page
        source = f"memory_budget_bytes={spec.memory_budget_bytes} ({per_page} bytes a page)"
    else:
        capacity, source = total, "sized to the request"
    if total > capacity:
        raise CacheCapacityError(
            f"the request needs {total} KV pages of {spec.page_size} tokens ({sum(token_budgets)} tokens over "
            f"{len(token_budgets)} sequences), but the pool holds {capacity} ({source})"
        )
    P = max(need)
    tables = np.zeros((len(need), P), np.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = np.arange(start, start + n)
        start += n
    return max(capacity, 1), tables
