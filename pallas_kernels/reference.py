"""The "xla" implementations: plain jnp, dequantise then dot with fp32 accumulation.

They are what XLA does without custom kernels (the dequantised weight is materialised), so they double
as the baseline the kernels are timed against. A weight with an input_scale first fake-quantises its
input exactly as ModelOpt does (`fake_quantize_input`, pallas_kernels.formats), then the same math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.formats import Weight, dequantize


def _quantized_input(x, w: Weight, rows=None):
    """x [..., K] as the op reads it: fake-quantised with w's input_scale (indexed by `rows`, the expert of
    each row, for stacked experts) in x.dtype, or x itself for a weight-only w."""
    s = getattr(w, "input_scale", None)
    if s is None:
        return x
    return type(w).fake_quantize_input(x, s if rows is None else s[rows]).astype(x.dtype)


def linear(x, w: Weight):
    """x [..., K] @ dequant(W [N, K])^T -> [..., N] in x.dtype, fp32 accumulation."""
    x = _quantized_input(x, w)
    wd = dequantize(w, x.dtype)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.einsum("...k,nk->...n", x, wd, preferred_element_type=jnp.float32, precision=precision)
    return y.astype(x.dtype)


GATHER_MAX_PAIRS = 256  # up to this many token-expert pairs the reference gathers each pair's expert


def moe_experts(x, expert_idx, expert_weight, up: Weight, down: Weight):
    """Routed experts in fp32: x [T, H], expert_idx int32 [T, k], expert_weight f32 [T, k], up [E, F, H],
    down [E, H, F] -> [T, H] in x.dtype.

    Few pairs (decode): each token's k experts are gathered and dequantised. Many pairs (prefill): the
    pairs are sorted by expert and two ragged_dots run over the dequantised experts (a gather would hold
    a dequantised expert copy per pair). Experts with input scales quantise each pair's input (x, then
    the hidden activation) with the scale of the pair's expert."""
    if expert_idx.size <= GATHER_MAX_PAIRS:
        take = lambda w: jax.tree.map(lambda a: a[expert_idx], w)
        hi = jax.lax.Precision.HIGHEST
        up_sel = dequantize(take(up), jnp.float32)      # [T, k, F, H]
        down_sel = dequantize(take(down), jnp.float32)  # [T, k, H, F]
        xk = jnp.broadcast_to(x.astype(jnp.float32)[:, None], (*expert_idx.shape, x.shape[1]))
        h = jnp.einsum("tkfh,tkh->tkf", up_sel, _quantized_input(xk, up, expert_idx), precision=hi)
        h = _quantized_input(jnp.square(jnp.maximum(h, 0.0)), down, expert_idx)
        o = jnp.einsum("tkhf,tkf->tkh", down_sel, h, precision=hi)
        y = jnp.einsum("tk,tkh->th", expert_weight.astype(jnp.float32), o, precision=hi)
        return y.astype(x.dtype)
    T, k = expert_idx.shape
    flat = expert_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=up.shape[0]).astype(jnp.int32)
    dot = lambda lhs, w: jax.lax.ragged_dot(lhs, jnp.swapaxes(dequantize(w, jnp.float32), 1, 2), sizes,
                                            precision=jax.lax.Precision.HIGHEST,
                                            preferred_element_type=jnp.float32)
    pair_expert = flat[order]
    h = jnp.square(jnp.maximum(dot(_quantized_input(x.astype(jnp.float32)[token], up, pair_expert), up), 0.0))
    o = dot(_quantized_input(h, down, pair_expert), down) * expert_weight.reshape(-1).astype(jnp.float32)[order][:, None]
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[token].add(o).astype(x.dtype)
