"""moe_experts: the routed-experts computation of a NemotronH MoE layer, reading only selected experts.

Token-expert pairs are grouped by expert into blocks of `tm` rows (XLA, tiny, by counting; a single token
gets one block per expert without that, every block reading the token's row); each kernel CTA indexes its
block's expert from the block->expert table, so only the selected experts' weights are ever fetched,
in their stored (packed) form: no gather of all experts, no dequantised copy, no dense pass over E as
jax.lax.ragged_dot does. The weighted combine gathers each token's k expert rows and sums them (fp32,
in a fixed order): no scatter-add, whose float atomics would add in a different order from run to run. Decode
uses 8-row blocks; prefill, with many tokens per expert, blocks of up to 64 rows, so an expert's
weights are streamed once per 64 of its tokens (128-row blocks measured slower on the H200: prefill
MoE is compute-bound there, and wider blocks waste more rows on the last, partly filled block); a
prefill block's CTAs multiply it with three 64-row tiles of its expert's weight each, where the grid
still fills the GPU (pallas_kernels._blocked.Tiling). Two kernel launches (up, down), the weighted
combine in XLA after them; relu^2 is applied in the up projection's kernel where it runs one split under
wgmma (prefill blocks, Tiling.fused_relu2), else in XLA between the two. The hidden activation relu(up
x)^2 enters the down projection in x.dtype, as in the reference model. Experts with
input scales (W8A8 / W4A4) quantise each block's rows with the block expert's input_scale to exact
codes (pallas_kernels.linear), which the weight-only kernel reads with input_scale folded into the
expert's output scale.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels._backend import resolve_impl
from pallas_kernels import _blocked
from pallas_kernels._blocked import Tiling, blocked_linear, row_blocks
from pallas_kernels.formats import Weight

MOE_BLOCK_ROWS = 8  # decode: a token's k experts each get a block


def block_rows_for(pairs: int, num_experts: int, max_rows: int) -> int:
    """Rows per expert block: the expected pairs per expert rounded up to a power of two, in [8, max_rows]."""
    tm = MOE_BLOCK_ROWS
    while tm < max_rows and tm * num_experts < pairs:
        tm *= 2
    return tm


def _pair_valid(valid, expert_idx):
    """valid [T] (per token) or [T, k] (per pair) -> [T*k] bool, one per (token, expert) pair."""
    t, k = expert_idx.shape
    return jnp.broadcast_to(valid.reshape(t, -1), (t, k)).reshape(t * k)


COUNT_BLOCK_PAIRS = 512  # route_blocks counts a pair's earlier same-expert pairs within blocks of this many pairs


def route_blocks(expert_idx, num_experts: int, tm: int = MOE_BLOCK_ROWS, valid=None):
    """Group the T*k (token, expert) pairs by expert into blocks of tm slots; pairs left out by valid
    ([T] per token or [T, k] per pair, False: left out) get no slot.

    Returns (slot_pair int32 [B*tm]: pair index t*k+j in each slot, T*k for an empty slot;
    block_expert int32 [B]: expert of each block, -1 for unused blocks; pair_slot int32 [T*k]: the slot
    of each pair, B*tm for a left-out pair). B is a static bound.
    """
    pairs = expert_idx.size
    e = expert_idx.reshape(pairs).astype(jnp.int32)
    if valid is not None:  # left-out pairs go to a sentinel expert past the last
        e = jnp.where(_pair_valid(valid, expert_idx), e, num_experts)
    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[e].add(1)[:num_experts]
    blocks = -(-counts // tm)
    block_end = jnp.cumsum(blocks)
    pair_ids = jnp.arange(pairs, dtype=jnp.int32)
    e_kept = jnp.minimum(e, num_experts - 1)
    # each pair's place among its expert's pairs (how many earlier pairs chose that expert), no sort on
    # the critical path: a compare-and-count XLA fuses into a reduction within blocks of COUNT_BLOCK_PAIRS
    # pairs (a decode batch's pairs are one block), plus the expert's pairs in the blocks before (a
    # 2,048-token prefill's 12,288 pairs: 24 blocks, where a stable argsort took ~47 us on the H200)
    width = max(min(pairs, COUNT_BLOCK_PAIRS), 1)
    n_blocks = -(-pairs // width)
    eb = jnp.pad(e, (0, n_blocks * width - pairs), constant_values=num_experts).reshape(n_blocks, width)
    earlier = pair_ids[None, :width] < pair_ids[:width, None]  # [i, j]: j comes before i
    rank = jnp.sum((eb[:, None, :] == eb[:, :, None]) & earlier, axis=2, dtype=jnp.int32)
    if n_blocks > 1:
        per_block = jnp.sum(eb[:, :, None] == jnp.arange(num_experts + 1, dtype=jnp.int32), axis=1, dtype=jnp.int32)
        rank = rank + jnp.take_along_axis(jnp.cumsum(per_block, axis=0) - per_block, eb, axis=1)
    rank = rank.reshape(-1)[:pairs]
    num_blocks = min(num_experts, pairs) + pairs // tm
    pair_slot = jnp.where(e < num_experts, (block_end - blocks)[e_kept] * tm + rank, num_blocks * tm)
    slot_pair = jnp.full((num_blocks * tm,), pairs, jnp.int32).at[pair_slot].set(pair_ids, mode="drop")
    ids = jnp.arange(num_blocks, dtype=jnp.int32)
    # compare_all: one fused [B, E] comparison; the default binary search is a while loop, which on the GPU
    # splits the decode step's CUDA graph and runs its iterations one by one
    block_expert = jnp.searchsorted(block_end, ids, side="right", method="compare_all").astype(jnp.int32)
    return slot_pair, jnp.where(ids < block_end[-1], block_expert, -1), pair_slot


def pair_blocks(expert_idx, tm: int = MOE_BLOCK_ROWS, valid=None):
    """One block per (token, expert) pair, the pair in slot 0, for a single token (decode), whose k
    experts are distinct anyway: fewer ops than route_blocks. Same outputs as route_blocks."""
    pairs = expert_idx.size
    slots = jnp.arange(pairs * tm, dtype=jnp.int32)
    slot_pair = jnp.where(slots % tm == 0, slots // tm, pairs)
    block_expert = expert_idx.reshape(pairs).astype(jnp.int32)
    pair_slot = jnp.arange(pairs, dtype=jnp.int32) * tm
    if valid is not None:  # a left-out pair: its block unused, its slot empty
        kept = _pair_valid(valid, expert_idx)
        block_expert = jnp.where(kept, block_expert, -1)
        slot_pair = jnp.where(kept[slots // tm], slot_pair, pairs)
        pair_slot = jnp.where(kept, pair_slot, pairs * tm)
    return slot_pair, block_expert, pair_slot


def _quantized_blocks(xb, block_expert, w: Weight):
    """(rows [B, tm, K], stacked weight) as the kernel reads them: with an input_scale, each block's rows as
    exact codes of its expert's input quantisation and the weight with input_scale folded in; else as given."""
    s = getattr(w, "input_scale", None)
    if s is None:
        return xb, w
    return w.input_codes(xb, s[jnp.maximum(block_expert, 0)][:, None]), w.fold_input_scale()


def moe_experts(x, expert_idx, expert_weight, up: Weight, down: Weight, *, valid=None, impl=None,
                tiling: Tiling | None = None):
    """y[t] = sum_j expert_weight[t,j] * down[e] @ relu(up[e] @ x[t])^2, e = expert_idx[t,j].

    x [T, H] bf16/f32; expert_idx int32 [T, k]; expert_weight f32 [T, k]; up [E, F, H] and
    down [E, H, F] as dense arrays, FP8Weight or NVFP4Weight (stacked along E); valid [T] (per token) or
    [T, k] (per pair) bool, or None: pairs left out add nothing to y and read no expert weights (a
    sharded MoE leaves out the pairs of other devices' experts). fp32 accumulation; the kernel paths
    ("pallas", "interpret") round the hidden activation to x.dtype between the projections, the "xla"
    reference keeps it fp32; y [T, H] in x.dtype.
    """
    impl = resolve_impl(impl)
    tiling = tiling or _blocked.DEFAULT_TILING  # read when traced: benchmarks may rebind the default
    if impl == "xla":
        if valid is not None:
            expert_weight = jnp.where(valid.reshape(valid.shape[0], -1), expert_weight, 0.0)
        return reference.moe_experts(x, expert_idx, expert_weight, up, down)
    t, k = expert_idx.shape
    if t == 1:
        tm = MOE_BLOCK_ROWS
        slot_pair, block_expert, pair_slot = pair_blocks(expert_idx, tm, valid)
    else:
        tm = block_rows_for(expert_idx.size, up.shape[0], tiling.moe_block_rows)
        slot_pair, block_expert, pair_slot = route_blocks(expert_idx, up.shape[0], tm, valid)
    if t == 1 and getattr(up, "input_scale", None) is None:
        # every block reads the token's one row: the same activation block (and so, after XLA's common
        # subexpression elimination, the same preparation) as any other projection of x, e.g. the shared expert's
        xb = row_blocks(x, tm, tiling)
    else:
        slot_token = slot_pair // k  # T for empty slots: past the end, they read zero rows
        xb = x.at[slot_token].get(mode="fill", fill_value=0).reshape(-1, tm, x.shape[1])
    xb, up = _quantized_blocks(xb, block_expert, up)
    h = blocked_linear(xb, block_expert, up, impl, tiling, tm, relu2_dtype=x.dtype)
    h, down = _quantized_blocks(h, block_expert, down)
    o = blocked_linear(h, block_expert, down, impl, tiling, tm)
    # A block's product may hold fewer than tm rows (Tiling.store_real_rows: a single token's one row), each
    # pair's slot among them: the same place in its block. A left-out pair's slot is past the end: it
    # reads zero. Slots of unused blocks (left unwritten) are never read.
    held = o.shape[1]
    o = o.reshape(-1, o.shape[-1])
    # Each token's k expert rows weighted and summed in fp32: elementwise and a sum over k, which XLA fuses
    # (a dot would be a separate GEMM).
    rows = o.at[pair_slot // tm * held + pair_slot % tm].get(mode="fill", fill_value=0.0).reshape(t, k, -1)
    return (rows * expert_weight.astype(jnp.float32)[:, :, None]).sum(axis=1).astype(x.dtype)
