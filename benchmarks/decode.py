"""Decode benchmark at Nemotron-3 Nano dims: gate each layout, check each layer kind, then time decode.

    PYTHONPATH=. python3 benchmarks/decode.py [--layouts dense,NANO_FP8,NANO_NVFP4,MIXED]
        [--batches 1,8,32,64] [--prompt 128] [--steps 32] [--repeats 4] [--profile-batches 1]
        [--no-gate] [--out DIR]

Per layout (dense, or a quantiser recipe: NANO_FP8 / NANO_NVFP4 are the official selective layouts):
1. Token gate on this machine's device against transformers, at the real layer widths with reduced
   depth (GATE_PATTERN), GATE_EXPERTS routed experts and a GATE_VOCAB vocabulary: transformers makes a
   random fp32 checkpoint,
   nemoh's quantiser writes the layout, the oracle runs its numpy dequantisation. Greedy fp32 tokens of
   nemoh against the oracle's, plus the margin check: nemoh's own tokens with every projection scaled by
   1.001 must not move, or the gate could not tell a bug from noise. (bf16 is checked per layer, 3.)
2. Random params at full Nano size (52 layers, 128 experts) built on the device (nemoh.random_params).
3. Per-layer check at full width: the first layer of each kind (and lm_head) through the GPU path in
   bf16 against the "xla" reference in fp32 on identical inputs, as a relative error.
4. Per batch: prefill of random prompts (first call = compile + run, second = run), decode warm-up
   (compile), then `repeats` timed decode calls of `steps` steps: median ms per step, tok/s, bytes
   moved per step against the HBM ceiling measured in this run, peak device memory; with
   --profile-batches, a profiled decode call gives launches per step and the per-layer-kind split.
Results: decode.jsonl (one JSON object per leg, appended as it completes) and decode-<layouts>.md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import nemoh
from benchmarks.common import (NANO_DIMS, NANO_PATTERN, bytes_per_step, describe_layout, hbm_ceiling_gbs,
                               nano_config, peak_memory_bytes)
from benchmarks.profile import breakdown_table, profile_breakdown
from nemoh import oracle
from nemoh.config import ATTENTION, MAMBA, MLP, MOE
from nemoh.engine.decode import _decode, decode
from nemoh.engine.kv_pages import CacheSpec
from nemoh.engine.prefill import prefill
from nemoh.engine.sampling import Sampling
from nemoh.gate import compare, default_prompts
from nemoh.layers.attention import KVPages
from nemoh.layers.context import TokenContext
from nemoh.layers.mamba2 import MambaState
from nemoh.model import apply_mixer, layer_scope, logits_from_hidden
from nemoh.random_params import random_params
from pallas_kernels import FP8Weight, NVFP4Weight, default_impl, is_quantized

GATE_PATTERN = "MEM*EM"  # every kind, a Mamba layer next to attention (kept dense by the NANO recipes)
GATE_EXPERTS = 16
GATE_VOCAB = 16384  # the lm_head runs the same kernel at any vocabulary; a smaller one keeps the oracle quick
GATE_NEW_TOKENS = 12
LAYER_CHECK_MAX_ERR = 3e-2  # bf16 kernels vs fp32 reference through one layer


def log(*a):
    print(*a, flush=True)


# ---- 1. the gate -------------------------------------------------------------------------------------

def perturbed(params, factor: float = 1.001):
    """params with every projection scaled by `factor` (dense weights, FP8 scales, NVFP4 global scales)."""
    def scale(w):
        if isinstance(w, FP8Weight):
            return FP8Weight(w.data, w.scale * factor)
        if isinstance(w, NVFP4Weight):
            return NVFP4Weight(w.packed, w.scale, w.global_scale * factor)
        return w * factor if w.ndim >= 2 and jnp.issubdtype(w.dtype, jnp.floating) else w
    return jax.tree.map(scale, params, is_leaf=is_quantized)


def gate(layout: str, workdir: Path, dims: Path) -> str:
    """Gate line for `layout` at reduced depth (see module docstring)."""
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
    ref = [r["tokens"] for r in oracle.greedy([dict(model_dir=str(oracle_dir), prompts=prompts,
                                                    max_new_tokens=GATE_NEW_TOKENS, stop_token_ids=[],
                                                    dtype="float32")])[0]]
    run = lambda p: nemoh.generate(p, prompts, max_new_tokens=GATE_NEW_TOKENS, ignore_eos=True)
    ours32 = run(params32)
    stable = compare(run(perturbed(params32)), ours32)
    return (f"gate {GATE_PATTERN}, {GATE_EXPERTS} experts, vocab {GATE_VOCAB}: fp32 {compare(ours32, ref).line()}; "
            f"x1.001 margin check {stable.matched}/{stable.total}{' stable' if stable.strict else ' UNSTABLE'}")


# ---- 3. per-layer check ----------------------------------------------------------------------------

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


def layer_check(params, batch: int, context: int) -> dict[str, float]:
    """Relative error of each layer kind's bf16 GPU path against the fp32 "xla" reference."""
    cfg = params.config
    key = jax.random.key(1)
    page = 16
    pages_per_seq = -(-(context + 1) // page)
    ctx = TokenContext(positions=jnp.full((batch, 1), context, jnp.int32), valid_len=jnp.ones((batch,), jnp.int32),
                       block_tables=jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq))
    f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, tree)
    errors = {}
    for kind in (MAMBA, ATTENTION, MOE, MLP):
        if kind not in cfg.layer_kinds:
            continue
        layer = params.layers[cfg.layer_kinds.index(kind)]
        h = jax.random.normal(jax.random.fold_in(key, len(errors)), (batch, 1, cfg.hidden_size)).astype(jnp.bfloat16)
        state = _random_state(kind, cfg, batch, context, jax.random.fold_in(key, 100 + len(errors)), jnp.bfloat16)
        fast = jax.jit(lambda l, h, s: apply_mixer(l, h, cfg, s, ctx)[0])(layer, h, state)
        with default_impl("xla"):
            ref = jax.jit(lambda l, h, s: apply_mixer(l, h, cfg, s, ctx)[0])(f32(layer), f32(h), f32(state))
        errors[layer_scope(layer)] = _rel(fast, ref)
    h = jax.random.normal(jax.random.fold_in(key, 99), (batch, cfg.hidden_size)).astype(jnp.bfloat16)
    fast = jax.jit(logits_from_hidden)(params, h)
    with default_impl("xla"):
        ref = jax.jit(lambda p, h: logits_from_hidden(p, h))(f32(params), f32(h))
    errors["lm_head"] = _rel(fast, ref)
    return errors


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)) if np.isfinite(a).all() else float("inf")


# ---- 4. timing ---------------------------------------------------------------------------------------

def time_batch(params, batch: int, prompt: int, steps: int, repeats: int, ceiling: float, profile: bool) -> dict:
    cfg = params.config
    max_new = steps * (repeats + 2) + 2
    prompts = [np.asarray(p, np.int32) for p in default_prompts(cfg, [prompt] * batch, seed=batch)]
    run_prefill = lambda: prefill(params, prompts, max_new_tokens=max_new, sampling=Sampling(), stop_ids=(),
                                  seed=0, cache=CacheSpec())
    t0 = time.perf_counter()
    carry = run_prefill()
    jax.block_until_ready(carry.tokens)
    prefill_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry = run_prefill()
    jax.block_until_ready(carry.tokens)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry = decode(params, carry, steps)
    jax.block_until_ready(carry.tokens)
    decode_first = time.perf_counter() - t0
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = decode(params, carry, steps)
        jax.block_until_ready(carry.tokens)
        per_step.append((time.perf_counter() - t0) / steps)
    step_s = statistics.median(per_step)
    moved = bytes_per_step(params, batch, prompt + steps * (repeats + 1))
    out = {
        "batch": batch, "prompt": prompt, "steps_timed": steps * repeats,
        "ms_per_step": 1e3 * step_s, "s_per_token": step_s / batch, "ms_per_token": 1e3 * step_s / batch,
        "tok_per_s": batch / step_s, "spread_ms": [1e3 * min(per_step), 1e3 * max(per_step)],
        "decode_compile_s": decode_first - step_s * steps, "prefill_first_call_s": prefill_first,
        "prefill_compile_s": prefill_first - ttft, "ttft_s": ttft,
        "peak_device_bytes": peak_memory_bytes(),
        "bytes_per_step": moved, "weight_bytes_per_token": moved["weights"] / batch,
        "hbm_fraction": moved["total"] / step_s / (ceiling * 1e9),
    }
    if profile:
        hlo = _decode.lower(params, carry, np.int32(steps)).compile().as_text()
        holder = [carry]

        def run():
            holder[0] = decode(params, holder[0], steps)
            jax.block_until_ready(holder[0].tokens)

        out["profile"] = profile_breakdown(run, hlo, steps)
        out["kernel_launches_per_step"] = out["profile"]["kernels_per_step"]
    return out


# ---- driver --------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="dense,NANO_FP8,NANO_NVFP4,MIXED")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4, help="timed decode calls (>= 64 steps in all by default)")
    ap.add_argument("--profile-batches", default="1")
    ap.add_argument("--no-gate", action="store_true", help="skip the token gate (legs are labelled ungated)")
    ap.add_argument("--pattern", default=NANO_PATTERN, help="layer pattern of the timed model (default: Nano's 52)")
    ap.add_argument("--dims", default=str(NANO_DIMS), help="config.json fields giving the widths (default: Nano's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "nemoh-bench"))
    args = ap.parse_args()
    out_dir, work = Path(args.out), Path(args.workdir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "decode.jsonl"
    md_path = out_dir / f"decode-{args.layouts.replace(',', '-')}.md"
    device = jax.devices()[0].device_kind
    ceiling = hbm_ceiling_gbs()
    log(f"device {device} | jax {jax.__version__} | HBM ceiling {ceiling:.0f} GB/s (2 GiB bf16 read+write)")
    cfg = nano_config(args.pattern, dims=Path(args.dims))
    counts = {layer_scope_name: cfg.layer_kinds.count(kind)
              for kind, layer_scope_name in ((MAMBA, "mamba"), (ATTENTION, "attention"), (MOE, "moe"), (MLP, "mlp"))}
    md = [f"device {device}, jax {jax.__version__}, HBM ceiling {ceiling:.0f} GB/s; model {cfg.pattern} "
          f"({cfg.num_layers} layers), bf16, prompt {args.prompt}", ""]
    batches = [int(b) for b in args.batches.split(",")]
    profile_batches = {int(b) for b in args.profile_batches.split(",") if b}
    for layout in args.layouts.split(","):
        gate_line = "ungated"
        if not args.no_gate:
            t0 = time.perf_counter()
            try:
                gate_line = gate(layout, work, Path(args.dims))
            except Exception as exc:  # noqa: BLE001 - a failed gate is reported on the leg's line
                gate_line = f"GATE FAILED ({type(exc).__name__}: {str(exc)[:300]})"
            log(f"[{layout}] {gate_line} ({time.perf_counter() - t0:.0f} s)")
        jax.clear_caches()
        params = random_params(cfg, layout, dtype=jnp.bfloat16)
        errs = layer_check(params, batch=4, context=args.prompt)
        check = "layer check " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        check += " PASS" if max(errs.values()) < LAYER_CHECK_MAX_ERR else " FAIL"
        log(f"[{layout}] {check}; formats {describe_layout(params)}")
        for b in batches:
            try:
                r = time_batch(params, b, args.prompt, args.steps, args.repeats, ceiling, b in profile_batches)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory at a large batch: report, go on
                log(f"[{layout}] batch {b}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
                continue
            r.update(layout=layout, gate=gate_line, layer_check=errs, device=device, hbm_ceiling_gbs=ceiling)
            with jsonl.open("a") as f:
                f.write(json.dumps(r) + "\n")
            line = (f"[{layout}] batch {b}: {r['ms_per_step']:.3f} ms/step, {r['ms_per_token']:.3f} ms/token, "
                    f"{r['tok_per_s']:.0f} tok/s, {100 * r['hbm_fraction']:.0f}% of HBM ceiling, "
                    f"decode compile {r['decode_compile_s']:.1f} s, prefill compile {r['prefill_compile_s']:.1f} s, "
                    f"TTFT {r['ttft_s']:.3f} s, peak {r['peak_device_bytes'] / 2**30 if r['peak_device_bytes'] else 0:.1f} GiB"
                    f" | {gate_line} | {check}")
            log(line)
            md.append(line)
            if "profile" in r:
                table = breakdown_table(r["profile"], r["ms_per_step"] / 1e3, {**counts, "lm_head": 1})
                log(table)
                md += ["", f"{layout} batch {b}: {r['profile']['kernels_per_step']:.0f} kernel launches per step", "",
                       table, ""]
                top = r["profile"]["top_kernels"][:12]
                md += [f"- {t['scope']}: {t['kernel']}: {t['us_per_step']:.1f} µs/step, "
                       f"{t['launches_per_step']:.0f}/step" for t in top] + [""]
        del params
        md_path.write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
