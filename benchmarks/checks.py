"""Correctness checks the benchmarks print beside their timings.

1. Token gate on this machine's device against transformers, at the real layer widths with reduced
   depth (GATE_PATTERN), GATE_EXPERTS routed experts and a GATE_VOCAB vocabulary: transformers makes a
   random fp32 checkpoint, nemoh's quantiser writes the layout, the oracle runs its numpy dequantisation.
   Greedy fp32 tokens of nemoh against the oracle's, plus the margin check: nemoh's own tokens with every
   projection scaled by 1.001 must not move, or the gate could not tell a bug from noise. The oracle
   runs in $NEMOH_ORACLE_PYTHON or .venv-oracle, else (a GPU machine image with torch and transformers
   installed) in this interpreter.
2. Per-layer check at full width: the first layer of each kind (and lm_head) through the GPU path in
   bf16 against the "xla" reference in fp32 on identical inputs, as a relative error: a decode step of
   4 rows, then a 512-token prefill block (PREFILL_CHECK_TOKENS), whose paths differ.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import nemoh
from nemoh import oracle
from nemoh.config import ATTENTION, MAMBA, MLP, MOE
from nemoh.engine import xla_options
from nemoh.gate import compare, default_prompts
from nemoh.layers.attention import KVPages
from nemoh.layers.context import TokenContext
from nemoh.layers.mamba2 import MambaState
from nemoh.model import apply_mixer, layer_scope, logits_from_hidden
from pallas_kernels import FP8Weight, NVFP4Weight, default_impl, is_quantized

GATE_PATTERN = "MEM*EM"  # every kind, a Mamba layer next to attention (kept dense by the NANO recipes)
GATE_EXPERTS = 16
GATE_VOCAB = 16384  # the lm_head runs the same kernel at any vocabulary; a smaller one keeps the oracle quick
GATE_NEW_TOKENS = 12
LAYER_CHECK_MAX_ERR = 3e-2  # bf16 kernels vs fp32 reference through one layer
PREFILL_CHECK_TOKENS = 512  # a prefill block past linear's kernel bound (QUANT_KERNEL_MAX_ROWS), several SSD chunks


def log(*a):
    print(*a, flush=True)


def use_this_interpreter_as_oracle_if_needed() -> None:
    """Point the oracle at this interpreter when none is configured or set up and this one has torch
    and transformers (the GPU image), so the gate runs instead of failing for want of a virtualenv."""
    try:
        oracle.oracle_python()
    except oracle.OracleUnavailable:
        if all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
            os.environ[oracle.ENV_VAR] = sys.executable


def perturbed(params, factor: float = 1.001):
    """params with every projection scaled by `factor` (dense weights, FP8 scales, NVFP4 global scales)."""
    def scale(w):  # replace() keeps every other field: input_scale (activation quantisation) above all
        if isinstance(w, FP8Weight):
            return dataclasses.replace(w, scale=w.scale * factor)
        if isinstance(w, NVFP4Weight):
            return dataclasses.replace(w, global_scale=w.global_scale * factor)
        return w * factor if w.ndim >= 2 and jnp.issubdtype(w.dtype, jnp.floating) else w
    return jax.tree.map(scale, params, is_leaf=is_quantized)


def gate(layout: str, workdir: Path, dims: Path) -> str:
    """Gate line for `layout` at reduced depth (see module docstring)."""
    use_this_interpreter_as_oracle_if_needed()
    from nemoh.io.dequantize import dequantize_checkpoint
    from nemoh.io.quantize import quantize_checkpoint

    cfg_fields = {**json.loads(dims.read_text()),
                  "hybrid_override_pattern": GATE_PATTERN, "n_routed_experts": GATE_EXPERTS, "vocab_size": GATE_VOCAB,
                  "time_step_min": 1e-7, "time_step_floor": 1e-4}
    dense = workdir / "gate-dense"
    if not (dense / "config.json").exists():
        oracle.make_checkpoints([dict(config=cfg_fields, out_dir=str(dense), seed=0, dtype="float32",
                                      layout_spelling="pattern")])
    model_dir = oracle_dir = dense
    if layout != "dense":
        model_dir, oracle_dir = workdir / f"gate-{layout}", workdir / f"gate-{layout}-dq"
        if not (model_dir / "config.json").exists():
            quantize_checkpoint(dense, model_dir, layout)
            dequantize_checkpoint(model_dir, oracle_dir, dtype="float32")
    params32 = nemoh.load(model_dir, dtype=jnp.float32)
    prompts = default_prompts(params32.config, [5, 40], seed=0)
    ref = oracle_tokens(str(oracle_dir), tuple(tuple(int(t) for t in p) for p in prompts))
    run = lambda p: nemoh.generate(p, prompts, max_new_tokens=GATE_NEW_TOKENS, ignore_eos=True)
    ours32 = run(params32)
    stable = compare(run(perturbed(params32)), ours32)
    return (f"gate {GATE_PATTERN}, {GATE_EXPERTS} experts, vocab {GATE_VOCAB}: fp32 {compare(ours32, ref).line()}; "
            f"x1.001 margin check {stable.matched}/{stable.total}{' stable' if stable.strict else ' UNSTABLE'}")


@functools.cache
def oracle_tokens(oracle_dir: str, prompts: tuple[tuple[int, ...], ...]) -> list:
    """transformers' greedy tokens for the gate's prompts, once per checkpoint and process (a benchmark
    gating several kernel variants of one layout asks for the same reference each time)."""
    return [r["tokens"] for r in oracle.greedy([dict(model_dir=oracle_dir, prompts=[list(p) for p in prompts],
                                                     max_new_tokens=GATE_NEW_TOKENS, stop_token_ids=[],
                                                     dtype="float32")])[0]]


def gate_line(layout: str, workdir: Path, dims: Path, skip: bool) -> str:
    """The gate's line for `layout`: "ungated" when skipped, "GATE FAILED (...)" naming the error when
    the gate could not run (the legs are still timed and carry that line)."""
    if skip:
        return "ungated"
    t0 = time.perf_counter()
    try:
        line = gate(layout, workdir, dims)
    except Exception as exc:  # noqa: BLE001 - a failed gate is reported on the leg's line
        line = f"GATE FAILED ({type(exc).__name__}: {str(exc)[:300]})"
    log(f"[{layout}] {line} ({time.perf_counter() - t0:.0f} s)")
    return line


def _random_state(kind, cfg, batch, context, key, dtype):
    if kind == MAMBA:
        k1, k2 = jax.random.split(key)
        s = MambaState.zeros(cfg, batch, dtype)
        return MambaState(conv=jax.random.normal(k1, s.conv.shape, jnp.float32).astype(dtype),
                          ssm=0.1 * jax.random.normal(k2, s.ssm.shape, jnp.float32))
    if kind == ATTENTION:
        page = 16
        pages_per_seq = -(-(context + 1) // page)
        p = KVPages.zeros(cfg, batch * pages_per_seq, page, dtype)
        k1, k2 = jax.random.split(key)
        return KVPages(k=jax.random.normal(k1, p.k.shape, jnp.float32).astype(dtype),
                       v=jax.random.normal(k2, p.v.shape, jnp.float32).astype(dtype))
    return None


# the fp32 references compile as the engine's programs do, without autotuning: their speed does not matter,
# and autotuning's scratch buffers need device memory that a bf16 Nano (59 GiB) leaves short on an 80 GB card
REFERENCE_XLA = {**xla_options.ENGINE, "xla_gpu_autotune_level": 0}


def _fp32_reference(fn, *args) -> np.ndarray:
    """fn(*args) traced with the "xla" ops, on the default device; where it does not fit there beside the
    model (RESOURCE_EXHAUSTED), on the host's CPU. A bf16 Nano MoE layer's experts widened to fp32 for a
    512-token block need ~9 GiB more than an 80 GB card holds beside the 59 GiB model."""
    with default_impl("xla"):
        try:
            return np.asarray(jax.jit(fn, compiler_options=REFERENCE_XLA)(*args))
        except jax.errors.JaxRuntimeError as exc:
            if "RESOURCE_EXHAUSTED" not in str(exc):
                raise
            log(f"fp32 reference on the host CPU: out of device memory ({str(exc).splitlines()[0][:160]})")
        return np.asarray(jax.jit(fn)(*jax.device_put(args, jax.devices("cpu")[0])))


def layer_check(params, batch: int, context: int, tokens: int = 1) -> dict[str, float]:
    """Relative error of each layer kind's bf16 GPU path against the fp32 "xla" reference, for `tokens`
    new tokens a row after `context` cached ones (1: a decode step; more: a prefill chunk, whose paths
    differ: the chunked SSD scan, dequantised prefill projections, 64-row expert blocks). The lm_head is
    checked with a decode step's rows only."""
    cfg = params.config
    key = jax.random.key(1)
    page = 16
    pages_per_seq = -(-(context + tokens) // page)
    ctx = TokenContext(positions=context + jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens)),
                       valid_len=jnp.full((batch,), tokens, jnp.int32),
                       block_tables=jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq))
    f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, tree)
    errors = {}
    for kind in (MAMBA, ATTENTION, MOE, MLP):
        if kind not in cfg.layer_kinds:
            continue
        layer = params.layers[cfg.layer_kinds.index(kind)]
        h = jax.random.normal(jax.random.fold_in(key, len(errors)), (batch, tokens, cfg.hidden_size)).astype(jnp.bfloat16)
        state = _random_state(kind, cfg, batch, context + tokens - 1, jax.random.fold_in(key, 100 + len(errors)),
                              jnp.bfloat16)
        fast = jax.jit(lambda l, h, s: apply_mixer(l, h, cfg, s, ctx)[0],
                       compiler_options=xla_options.ENGINE)(layer, h, state)
        # widened inside the program: no fp32 copy of the layer's weights is kept beside the model
        ref = _fp32_reference(lambda l, h, s, c: apply_mixer(f32(l), f32(h), cfg, f32(s), c)[0],
                              layer, h, state, ctx)
        errors[layer_scope(layer)] = _rel(fast, ref)
    if tokens > 1:
        return errors
    h = jax.random.normal(jax.random.fold_in(key, 99), (batch, cfg.hidden_size)).astype(jnp.bfloat16)
    head_only = dataclasses.replace(params, layers=())  # widening all of a bf16 Nano (60 GB) would not fit
    fast = jax.jit(logits_from_hidden, compiler_options=xla_options.ENGINE)(head_only, h)
    ref = _fp32_reference(lambda p, h: logits_from_hidden(f32(p), f32(h)), head_only, h)
    errors["lm_head"] = _rel(fast, ref)
    return errors


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)) if np.isfinite(a).all() else float("inf")


def layer_check_line(params, context: int = 128, prefill_tokens: int = PREFILL_CHECK_TOKENS) -> tuple[dict[str, float], str]:
    """(errors by layer kind, the printed line: errors and PASS/FAIL against LAYER_CHECK_MAX_ERR): a decode
    step of 4 rows, then one row's block of prefill_tokens tokens (keys "<kind> prefill")."""
    errs = layer_check(params, batch=4, context=context)
    chunk = layer_check(params, batch=1, context=context, tokens=prefill_tokens)
    line = ("layer check " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
            + f"; {prefill_tokens}-token block " + ", ".join(f"{k} {v:.1e}" for k, v in chunk.items()))
    errs.update({f"{k} prefill": v for k, v in chunk.items()})
    return errs, line + (" PASS" if max(errs.values()) < LAYER_CHECK_MAX_ERR else " FAIL")

