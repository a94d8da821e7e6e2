"""Prefill benchmark at Nemotron-3 Nano dims: prompt tokens per second, compile time, and a profile.

    PYTHONPATH=. python3 benchmarks/prefill.py [--layouts dense,NANO_NVFP4] [--shapes 1x2048,8x512]
        [--repeats 3] [--profile] [--no-gate] [--out DIR]

Per layout: the token gate and the per-layer check of benchmarks/checks.py, random params at full size
built on the device, then per shape (prompts x tokens, random prompts): the first prefill call (compile +
run), untimed calls for a second, then the median of `repeats` calls: prompt tokens per second (real
prompt tokens, not padding), ms per call and the host's part of it before the device starts (the
request's checks, cache plan and inputs built: prefill_program; the call sends the inputs), peak device
memory. The engine's default chunking is used (nemoh.engine.layout.chunk_width).
With --profile, one more call is profiled and its kernel time split by layer kind (benchmarks/profile.py).
Results: prefill.jsonl and prefill-<layouts>.md in --out.
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
from benchmarks.common import add_model_args, compile_seconds, model_setup, peak_memory_bytes, wall_s, warm_up
from benchmarks.profile import breakdown_table, profile_breakdown
from nemoh.engine.decode import finish_compiling
from nemoh.engine.kv_pages import CacheSpec
from nemoh.engine.prefill import _prefill, prefill, prefill_program
from nemoh.engine.sampling import Sampling
from nemoh.gate import default_prompts
from nemoh.random_params import random_params

NEW_TOKENS = 16  # the request's decode budget: sizes the KV pool, as a real request would


def prefill_request(params, rows: int, tokens: int) -> tuple[list[np.ndarray], dict]:
    """The benchmarks' prefill request: (`rows` random prompts of `tokens` tokens, prefill's keyword arguments:
    greedy, NEW_TOKENS to decode, the default cache and chunk, no mesh)."""
    prompts = [np.asarray(p, np.int32) for p in default_prompts(params.config, [tokens] * rows, seed=rows)]
    return prompts, dict(max_new_tokens=NEW_TOKENS, sampling=Sampling(), stop_ids=(), seed=0, cache=CacheSpec(),
                         prefill_chunk=None, mesh=None, rules=None)


def prefill_hlo(params, prompts, kw: dict) -> str:
    """The compiled prefill program's HLO text for that request (for a profile's attribution)."""
    p, x, static = prefill_program(params, prompts, **kw)
    return _prefill.lower(p, x, **static).compile().as_text()


def time_shape(params, rows: int, tokens: int, repeats: int, profile: bool) -> dict:
    prompts, kw = prefill_request(params, rows, tokens)
    run = lambda: jax.block_until_ready(prefill(params, prompts, **kw).tokens)
    with compile_seconds() as compiled:
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
    finish_compiling()  # the request's decode program, compiling beside prefill: not while timing
    warm_up(run)
    call_s = statistics.median(wall_s(run, repeats))
    # the host's part of a call before the device starts: checks, the cache plan, the inputs built
    send = lambda: jax.block_until_ready(prefill_program(params, prompts, **kw)[1])
    host_s = statistics.median(wall_s(send, repeats))
    out = {"rows": rows, "tokens": tokens, "prompt_tokens": rows * tokens, "ms_per_call": 1e3 * call_s,
           "host_ms_per_call": 1e3 * host_s,
           "tok_per_s": rows * tokens / call_s, "first_call_s": first, "compile_s": compiled["_prefill"],
           "peak_device_bytes": peak_memory_bytes()}
    if profile:
        out["profile"] = profile_breakdown(run, prefill_hlo(params, prompts, kw), 1)
        out["kernel_launches"] = out["profile"]["kernels"]
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """ "1x2048,8x512" -> [(1, 2048), (8, 512)] (prompts x tokens); "" -> []."""
    return [tuple(int(v) for v in shape.split("x")) for shape in filter(None, text.split(","))]


def prefill_line(layout: str, r: dict, gate_text: str, check: str) -> str:
    peak = (r["peak_device_bytes"] or 0) / 2**30
    rate = (f"{r['tok_per_s']:.0f} tok/s, {r['ms_per_call']:.1f} ms/call (host checks and inputs "
            f"{r['host_ms_per_call']:.1f} ms of it), compile {r['compile_s']:.1f} s")
    return f"[{layout}] prefill {r['rows']}x{r['tokens']}: {rate}, peak {peak:.1f} GiB | {gate_text} | {check}"


def prefill_legs(params, layout: str, shapes, repeats: int, profile: bool, out_dir: Path, counts: dict,
                 labels: dict, check: str) -> list[str]:
    """Time each (prompts, tokens) shape on `params`: append each record (with `labels`: gate,
    layer_check, device) to prefill.jsonl in out_dir, log its line; returns the lines (and profile
    tables) for the markdown summary. A shape that fails (e.g. out of memory) is reported and skipped."""
    md = []
    for rows, tokens in shapes:
        try:
            r = time_shape(params, rows, tokens, repeats, profile)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: report, go on
            log(f"[{layout}] prefill {rows}x{tokens}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
            continue
        r.update(layout=layout, **labels)
        with (out_dir / "prefill.jsonl").open("a") as f:
            f.write(json.dumps(r) + "\n")
        md.append(prefill_line(layout, r, labels["gate"], check))
        log(md[-1])
        if "profile" in r:
            table = breakdown_table(r["profile"], r["ms_per_call"], counts)
            log(table)
            top = r["profile"]["top_kernels"][:15]
            md += ["", table, ""] + [f"- {t['scope']}: {t['kernel']}: {t['us_per_step']:.1f} µs, "
                                     f"{t['launches_per_step']:.0f} launches" for t in top]
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="dense,NANO_NVFP4")
    ap.add_argument("--shapes", default="1x2048,8x512", help="prompts x tokens, comma separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    add_model_args(ap)
    args = ap.parse_args()
    out_dir, work, cfg, counts = model_setup(args)
    device = jax.devices()[0].device_kind
    md = [f"device {device}, jax {jax.__version__}; model {cfg.pattern} ({cfg.num_layers} layers), bf16", ""]
    shapes = parse_shapes(args.shapes)
    for layout in args.layouts.split(","):
        gate_text = gate_line(layout, work, Path(args.dims), args.no_gate)
        jax.clear_caches()
        params = random_params(cfg, layout, dtype=jnp.bfloat16)
        errs, check = layer_check_line(params)
        md += prefill_legs(params, layout, shapes, args.repeats, args.profile, out_dir, counts,
                           dict(gate=gate_text, layer_check=errs, device=device), check)
        del params
        (out_dir / f"prefill-{args.layouts.replace(',', '-')}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
