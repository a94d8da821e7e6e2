"""Decode benchmark at Nemotron-3 Nano dims: gate each layout, check each layer kind, then time decode.

    PYTHONPATH=. python3 benchmarks/decode.py [--layouts dense,NANO_FP8,NANO_NVFP4,MIXED]
        [--batches 1,8,32,64] [--prompt 128] [--steps 32] [--repeats 4] [--profile-batches 1]
        [--prefill-shapes 1x2048,8x512] [--call-overhead] [--routing-steps 4] [--sampling SPEC] [--no-gate]
        [--out DIR]

Per layout (dense, or a quantiser recipe: NANO_FP8 / NANO_NVFP4 are the official selective layouts):
1. The token gate of benchmarks/checks.py (fp32, reduced depth, real widths, against transformers).
2. Random params at full Nano size (52 layers, 128 experts) built on the device (nemoh.random_params).
3. The per-layer check of benchmarks/checks.py at full width (bf16 GPU path against the fp32 reference).
4. Per batch: prefill of random prompts (first call = compile + run, second = run), decode warm-up
   (compile), then `repeats` timed decode calls of `steps` steps: median ms per step, tok/s, bytes
   moved per step against the HBM ceiling measured in this run, peak device memory; with
   --profile-batches, a profiled decode call gives launches per step and the per-layer-kind split; with
   --call-overhead, calls of 1 and 64 steps split a call's time into a fixed part and a part per step;
   above batch 1, --routing-steps probed steps (benchmarks/routing.py) count the distinct experts a MoE
   layer reads per step, printed beside uniform routing's count with the HBM fraction for that count
   (random weights may route a batch's rows alike, which makes its step cheaper than served text would);
   --sampling draws the tokens (e.g. "temperature=1.0") instead of taking the greedy ones.
5. With --prefill-shapes, the prefill legs of benchmarks/prefill.py on the same params, under the same gate.
Results: decode.jsonl (one JSON object per leg, appended as it completes) and decode-<layouts>.md in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.checks import gate_line, layer_check_line, log
from benchmarks.common import (add_model_args, bytes_per_step, compile_seconds, describe_layout,
                               expected_distinct_experts, hbm_ceiling_gbs, model_setup, parse_sampling,
                               parse_tilings, peak_memory_bytes, wall_s)
from benchmarks.prefill import parse_shapes, prefill_legs
from benchmarks.profile import breakdown_table, profile_breakdown
from benchmarks.routing import routed_experts
from nemoh.engine.decode import _decode, decode
from nemoh.engine.kv_pages import CacheSpec
from nemoh.engine.prefill import prefill
from nemoh.engine.sampling import Sampling
from nemoh.gate import default_prompts
from nemoh.random_params import random_params
from pallas_kernels import _blocked

OVERHEAD_CALLS = ((1, 5), (64, 3))  # (steps a call, calls) that split a call's time into fixed + per step


def call_overhead(params, carry) -> tuple[dict, object]:
    """Time decode calls of 1 and of 64 steps: a call of n steps takes fixed + n * per_step (host work
    before and after the launch, and whatever the device does once a call). Returns the fit (ms) and the
    carry."""
    holder, medians = [carry], {}
    for n, calls in OVERHEAD_CALLS:
        def run(n=n):
            holder[0] = decode(params, holder[0], n)
            jax.block_until_ready(holder[0].tokens)

        medians[n] = statistics.median(wall_s(run, calls))
    carry = holder[0]
    (n1, _), (n2, _) = OVERHEAD_CALLS
    per_step = (medians[n2] - medians[n1]) / (n2 - n1)
    return {"fixed_ms_per_call": 1e3 * (medians[n1] - n1 * per_step), "ms_per_step": 1e3 * per_step}, carry


def time_batch(params, batch: int, prompt: int, steps: int, repeats: int, ceiling: float, profile: bool,
               overhead: bool = False, routing_steps: int = 0, sampling: Sampling = Sampling()) -> dict:
    cfg = params.config
    max_new = (steps * (repeats + 2) + 2 + (sum(n * calls for n, calls in OVERHEAD_CALLS) if overhead else 0)
               + routing_steps)
    prompts = [np.asarray(p, np.int32) for p in default_prompts(cfg, [prompt] * batch, seed=batch)]
    run_prefill = lambda: prefill(params, prompts, max_new_tokens=max_new, sampling=sampling, stop_ids=(),
                                  seed=0, cache=CacheSpec())
    with compile_seconds() as compiled:  # the decode program compiles beside the first prefill call
        t0 = time.perf_counter()
        carry = run_prefill()
        jax.block_until_ready(carry.tokens)
        prefill_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        carry = decode(params, carry, steps)
        jax.block_until_ready(carry.tokens)
        decode_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry = run_prefill()
    jax.block_until_ready(carry.tokens)
    ttft = time.perf_counter() - t0
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = decode(params, carry, steps)
        jax.block_until_ready(carry.tokens)
        per_step.append((time.perf_counter() - t0) / steps)
    step_s = statistics.median(per_step)
    context = prompt + steps * (repeats + 1)  # tokens a row holds by the last timed step
    hbm_fraction = lambda moved: moved["total"] / step_s / (ceiling * 1e9)
    moved = bytes_per_step(params, batch, context)
    out = {
        "batch": batch, "prompt": prompt, "steps_timed": steps * repeats,
        "ms_per_step": 1e3 * step_s, "s_per_token": step_s / batch, "ms_per_token": 1e3 * step_s / batch,
        "tok_per_s": batch / step_s, "spread_ms": [1e3 * min(per_step), 1e3 * max(per_step)],
        "ms_per_step_by_call": [1e3 * t for t in per_step],
        "prefill_compile_s": compiled["_prefill"], "decode_compile_s": compiled["_decode"],
        "prefill_first_call_s": prefill_first, "decode_compile_wait_s": decode_first - step_s * steps,
        "first_calls_s": prefill_first + decode_first - step_s * steps, "ttft_s": ttft,
        "peak_device_bytes": peak_memory_bytes(),
        "bytes_per_step": moved, "weight_bytes_per_token": moved["weights"] / batch,
        "hbm_fraction": hbm_fraction(moved),
    }
    if profile:
        hlo = _decode.lower(params, carry, np.int32(steps)).compile().as_text()
        holder = [carry]

        def run():
            holder[0] = decode(params, holder[0], steps)
            jax.block_until_ready(holder[0].tokens)

        out["profile"] = profile_breakdown(run, hlo, steps)
        out["kernel_launches_per_step"] = out["profile"]["kernels_per_step"]
        carry = holder[0]
    if overhead:
        out["call_overhead"], carry = call_overhead(params, carry)
    if batch > 1 and routing_steps:
        routing, carry = routed_experts(params, carry, routing_steps)
        routing["uniform"] = expected_distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch)
        routed = bytes_per_step(params, batch, context, routing["mean"])
        out.update(routing=routing, bytes_per_step_routed=routed, hbm_fraction_routed=hbm_fraction(routed))
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
    ap.add_argument("--prefill-shapes", default="", help="prefill legs (prompts x tokens) after the decode legs")
    ap.add_argument("--call-overhead", action="store_true",
                    help="also split a decode call's time into a fixed part and a part per step (1- and 64-step calls)")
    ap.add_argument("--routing-steps", type=int, default=4,
                    help="probed decode steps after a batch's timed calls, counting the experts it reads (0: none)")
    ap.add_argument("--sampling", default="", help='decode tokens drawn, not greedy, e.g. "temperature=1.0"')
    ap.add_argument("--tiling", default="", help='kernel tiling for every Pallas op, e.g. "tk=128,ctas_per_sm=8" '
                    "(default: each op's own choice)")
    add_model_args(ap)
    args = ap.parse_args()
    if args.tiling:
        (_blocked.DEFAULT_TILING,) = parse_tilings(args.tiling)
    out_dir, work, cfg, counts = model_setup(args)
    jsonl = out_dir / "decode.jsonl"
    md_path = out_dir / f"decode-{args.layouts.replace(',', '-')}.md"
    device = jax.devices()[0].device_kind
    ceiling = hbm_ceiling_gbs()
    log(f"device {device} | jax {jax.__version__} | HBM ceiling {ceiling:.0f} GB/s "
        "(2 GiB bf16: best of a read and an in-place scale)")
    md = [f"device {device}, jax {jax.__version__}, HBM ceiling {ceiling:.0f} GB/s; model {cfg.pattern} "
          f"({cfg.num_layers} layers), bf16, prompt {args.prompt}", ""]
    batches = [int(b) for b in args.batches.split(",")]
    profile_batches = {int(b) for b in args.profile_batches.split(",") if b}
    prefill_shapes = parse_shapes(args.prefill_shapes)
    for layout in args.layouts.split(","):
        gate_text = gate_line(layout, work, Path(args.dims), args.no_gate)
        jax.clear_caches()
        params = random_params(cfg, layout, dtype=jnp.bfloat16)
        errs, check = layer_check_line(params, args.prompt)
        log(f"[{layout}] {check}; formats {describe_layout(params)}")
        for b in batches:
            try:
                r = time_batch(params, b, args.prompt, args.steps, args.repeats, ceiling, b in profile_batches,
                               args.call_overhead, args.routing_steps, parse_sampling(args.sampling))
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory at a large batch: report, go on
                log(f"[{layout}] batch {b}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
                continue
            r.update(layout=layout, gate=gate_text, layer_check=errs, device=device, hbm_ceiling_gbs=ceiling,
                     tiling=args.tiling or "default", sampling=args.sampling or "greedy")
            with jsonl.open("a") as f:
                f.write(json.dumps(r) + "\n")
            by_call = "/".join(f"{t:.2f}" for t in r["ms_per_step_by_call"])
            line = (f"[{layout}] batch {b}: {r['ms_per_step']:.3f} ms/step (timed calls {by_call}), "
                    f"{r['ms_per_token']:.3f} ms/token, "
                    f"{r['tok_per_s']:.0f} tok/s, {100 * r['hbm_fraction']:.0f}% of HBM ceiling, "
                    f"decode compile {r['decode_compile_s']:.1f} s, prefill compile {r['prefill_compile_s']:.1f} s "
                    f"(first calls {r['first_calls_s']:.1f} s), "
                    f"TTFT {r['ttft_s']:.3f} s, peak {r['peak_device_bytes'] / 2**30 if r['peak_device_bytes'] else 0:.1f} GiB"
                    + (", a call {fixed_ms_per_call:.2f} ms + {ms_per_step:.3f} ms a step".format(**r["call_overhead"])
                       if "call_overhead" in r else "")
                    + (", routed experts {mean:.1f} a MoE layer and step (uniform routing: {uniform:.1f})".format(
                        **r["routing"]) + f", {100 * r['hbm_fraction_routed']:.0f}% of HBM ceiling with them"
                       if "routing" in r else "")
                    + (f", tiling {args.tiling}" if args.tiling else "")
                    + (f", sampling {args.sampling}" if args.sampling else "") + f" | {gate_text} | {check}")
            log(line)
            md.append(line)
            if "profile" in r:
                table = breakdown_table(r["profile"], r["ms_per_step"], counts)
                log(table)
                md += ["", f"{layout} batch {b}: {r['profile']['kernels_per_step']:.0f} kernel launches per step", "",
                       table, ""]
                top = r["profile"]["top_kernels"][:12]
                md += [f"- {t['scope']}: {t['kernel']}: {t['us_per_step']:.1f} µs/step, "
                       f"{t['launches_per_step']:.0f}/step" for t in top] + [""]
        md += prefill_legs(params, layout, prefill_shapes, 3, False, out_dir, counts,
                           dict(gate=gate_text, layer_check=errs, device=device), check)
        del params
        md_path.write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
