"""KV page pool sizing and allocation: explicit, checked, never silently shrunk."""

from __future__ import annotations

import dataclasses

import numpy as np

from nemoh import validate
from nemoh.errors import CacheCapacityError, RequestError


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """How big the KV pool is: `num_pages` pages, or as many as fit `memory_budget_bytes` (over all
    attention layers, K and V), or (both None) the request's bucket: a full row of pages for every
    batch slot, shrunk to exactly the request's pages only when the bucket would not fit in memory."""

    page_size: int = 16
    num_pages: int | None = None
    memory_budget_bytes: int | None = None

    def __post_init__(self):
        validate.integer("page_size", self.page_size, 1, validate.INT32_MAX)
        validate.optional(validate.integer, "num_pages", self.num_pages, 1, validate.INT32_MAX)
        validate.optional(validate.integer, "memory_budget_bytes", self.memory_budget_bytes, 1)
        if self.num_pages is not None and self.memory_budget_bytes is not None:
            raise RequestError("give num_pages or memory_budget_bytes, not both")


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def shard_pages(token_budgets: list[int], page_size: int, rows: int, shards: int) -> list[int]:
    """Pages each batch shard needs: shard j holds rows [j*rows/shards, (j+1)*rows/shards) and their pages."""
    need = [0] * shards
    for i, t in enumerate(token_budgets):
        need[i // (rows // shards)] += pages_for(t, page_size)
    return need


def pool_sizes(page_bytes: int, spec: CacheSpec, token_budgets: list[int], bucket_pages: int, rows: int,
               shards: int = 1) -> list[int]:
    """Pool sizes to try, preferred first, for sequences of `token_budgets[i]` tokens (prompt + new) in
    `rows` slots, in a pool whose pages cost `page_bytes` each (over every layer, K and V): the user's
    num_pages / budget, or the bucket (`bucket_pages`) then exactly the pages needed. With batch shards
    (a mesh splitting the batch) the pool splits into equal parts, one per shard, each holding its rows'
    pages. Raises CacheCapacityError naming the need and the capacity when the user's pool is too small."""
    need = shard_pages(token_budgets, spec.page_size, rows, shards)
    if spec.num_pages is None and spec.memory_budget_bytes is None:
        return sorted({bucket_pages, shards * max(need)}, reverse=True)
    if spec.num_pages is not None:
        capacity, source = spec.num_pages, f"num_pages={spec.num_pages}"
    else:
        per_page = max(page_bytes, 1)
        capacity = spec.memory_budget_bytes // per_page // shards * shards
        source = f"memory_budget_bytes={spec.memory_budget_bytes} ({per_page} bytes a page)"
    if shards == 1 and need[0] > capacity:
        raise CacheCapacityError(
            f"the request needs {need[0]} KV pages of {spec.page_size} tokens ({sum(token_budgets)} tokens over "
            f"{len(token_budgets)} sequences), "
            f"but the pool holds {capacity} ({source})"
        )
    if max(need) > capacity // shards:
        raise CacheCapacityError(
            f"the request needs {max(need)} KV pages of {spec.page_size} tokens on one of its {shards} batch shards "
            f"(each holds the pages of its own rows), but the pool holds {capacity // shards} a shard ({source})"
        )
    return [capacity]


def block_tables(token_budgets: list[int], page_size: int, rows: int, width: int, shards: int = 1) -> np.ndarray:
    """[rows, width] int32: sequence i gets the next pages_for(token_budgets[i]) contiguous pages of its
    batch shard's part of the pool, numbered within that part (from 0 in every shard); the rest of each
    row (and every row past the sequences) is 0 and never written."""
    tables = np.zeros((rows, width), np.int32)
    start = [0] * shards
    for i, n in enumerate(pages_for(t, page_size) for t in token_budgets):
        j = i // (rows // shards)
        tables[i, :n] = np.arange(start[j], start[j] + n)
        start[j] += n
    return tables
