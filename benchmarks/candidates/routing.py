"""Candidate MoE routing kernel, to be timed against the library's XLA ops before it replaces them.

After the router's GEMV, a batch-1 MoE layer routes in three XLA launches on its critical path (the
sigmoid and bias; a sort of the 128 biased scores, XLA's own top-k kernel starting at 1,024 columns;
gathering and normalising the weights: ~5.8 µs on an H100, run 5's trace in docs/BENCHMARKS.md). Here
one Pallas kernel (Triton lowering), a program per token, takes the router logits to expert ids and
weights: sigmoid, bias, k rounds of "largest, lowest index first" (lax.top_k's order and tie rule),
then the weights from the unbiased scores, normalised and scaled as the library does.

`fused_route` has nemoh.layers.moe.route's signature; it runs the kernel for one routing group and a
power-of-two expert count (on the GPU, or the Pallas interpreter under default_impl("interpret")), the
library's route otherwise. benchmarks/decode.py --routing-kernel swaps it in. Written for Pallas'
Triton lowering, which jax 0.11 deprecates: a kernel the library adopts is a Mosaic GPU port.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from nemoh.layers import moe
from pallas_kernels._backend import resolve_impl

_LIBRARY_ROUTE = moe.route


def _kernel(logits_ref, bias_ref, idx_ref, w_ref, *, E, k, normalise, scale):
    t = pl.program_id(0)
    logits = logits_ref[t, pl.ds(0, E)]
    scores = 1.0 / (1.0 + jnp.exp(-logits))
    choice = scores + bias_ref[pl.ds(0, E)]
    ids = jnp.arange(E, dtype=jnp.int32)
    picked, weights = [], []
    for _ in range(k):
        best = jnp.max(choice)
        j = jnp.min(jnp.where(choice == best, ids, E))  # the lowest index among equal maxima
        picked.append(j)
        weights.append(jnp.sum(jnp.where(ids == j, scores, 0.0)))
        choice = jnp.where(ids == j, -jnp.inf, choice)
    total = sum(weights[1:], weights[0])
    for r in range(k):
        w = weights[r] / (total + 1e-20) if normalise else weights[r]
        idx_ref[t, r] = picked[r]
        w_ref[t, r] = w * scale


def fused_route(x, router, bias, cfg):
    """moe.route (same signature and results) with the steps after the router GEMV in one kernel."""
    impl = resolve_impl(None)
    E = router.shape[0]
    if impl == "xla" or cfg.n_group > 1 or E & (E - 1):
        return _LIBRARY_ROUTE(x, router, bias, cfg)
    logits = moe.router_logits(x, router)
    T, k = x.shape[0], cfg.num_experts_per_tok
    kernel = functools.partial(_kernel, E=E, k=k, normalise=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T, k), jnp.int32), jax.ShapeDtypeStruct((T, k), jnp.float32)),
        grid=(T,),
        interpret=impl == "interpret",
        compiler_params=plt.CompilerParams(num_warps=4),
        name="moe_route",
    )(logits, bias.astype(jnp.float32))


def swap_in() -> None:
    """Make the library's MoE layers route with fused_route (benchmarks/decode.py --routing-kernel)."""
    moe.route = fused_route
