"""Kernel tilings or XLA options compared on the decode step (and prefill) in one process: one model, one
compiled program per variant, timed calls interleaved A B B A ..., so drift and the spread between
processes (0.07-0.17 ms on the H100 at batch 1, as much as the levers tried) cancel out of the comparison.

    PYTHONPATH=. python3 benchmarks/ab.py [--layout NANO_NVFP4] [--batches 1,32] [--tilings "bf16_operands=false"]
        [--xla-options "xla_gpu_enable_cub_radix_sort=false"] [--sampling "temperature=0.8,top_p=0.9"]
        [--prefill-shapes 1x2048] [--steps 32] [--rounds 4] [--no-gate] [--out DIR]

Variant A is the default tiling under the engine's own XLA options; each --tilings entry (';' between
them; benchmarks/common.py's parse_tilings) and each --xla-options set (';' between sets, spaces between
options; parse_xla_options) is a B, an option set being compiled into its programs on top of
nemoh.engine.xla_options. Per tiling: the token gate of benchmarks/checks.py under that tiling (fp32,
reduced depth, real widths, against transformers) and the full-width layer check; an option set shares
the default's (they compile without it), and what checks its program is the comparison of its timed
calls' tokens with the default's. Per batch: random prompts prefilled once per variant (same prompts),
then per round one timed `steps`-step call of each variant; the result is each variant's median
ms/step and the median, min and max over rounds of its ratio to A in the same round, and whether its
tokens equal A's (greedy, or with --sampling drawn from the same seeds, which runs the sampler): a
tiling that changes the split-K sums or the operand dtype (bf16_operands) may change roundings, so a
mismatch is reported, not failed (random full-width nets amplify one flipped rounding into other
tokens). The float32 gate does not reach bf16_operands (float32 activations take the float16 path);
the layer check, in bf16, does. With --prefill-shapes, prefill (prompts x tokens) is compared the same
way: one compiled prefill program per variant, interleaved calls, prompt tokens per second. Results:
ab.jsonl and ab-<layout>.md in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.checks import gate_line, layer_check_line, log
from benchmarks.common import add_model_args, model_setup, parse_sampling, parse_tilings, parse_xla_options
from benchmarks.prefill import parse_shapes, prefill_request
from nemoh.engine.decode import _decode, finish_compiling
from nemoh.engine.kv_pages import CacheSpec
from nemoh.engine.prefill import _prefill, prefill, prefill_program
from nemoh.engine.sampling import Sampling
from nemoh.gate import default_prompts
from nemoh.random_params import random_params
from pallas_kernels import _blocked


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compared program: the kernel tiling it is traced under and XLA options compiled into it (on
    top of the engine's own)."""

    tiling: _blocked.Tiling = _blocked.Tiling()
    xla: tuple[tuple[str, object], ...] = ()

    def compile(self, lower):
        """lower() -> Lowered, traced under this tiling, compiled with these options."""
        return with_tiling(self.tiling, lambda: lower().compile(dict(self.xla) or None))


def with_tiling(tiling, fn):
    """fn() traced with `tiling` as every op's default (ops read it while tracing; caches cleared so
    nothing traced under another tiling is reused)."""
    default = _blocked.DEFAULT_TILING
    _blocked.DEFAULT_TILING = tiling
    jax.clear_caches()
    try:
        return fn()
    finally:
        _blocked.DEFAULT_TILING = default


WARM_ROUNDS = (2, 4)  # untimed rounds before timing: at least 2, more while under WARM_S, at most 4
WARM_S = 1.0


def interleaved(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each call (name -> blocking fn) per round, after untimed rounds of all (WARM_ROUNDS:
    first calls after a compile run slow for a while); the order alternates (A B .. B A) so that drift
    falls on every variant alike."""
    t0, warm = time.perf_counter(), 0
    while warm < WARM_ROUNDS[0] or (warm < WARM_ROUNDS[1] and time.perf_counter() - t0 < WARM_S):
        for call in calls.values():
            call()
        warm += 1
    names, seconds = list(calls), {name: [] for name in calls}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            calls[name]()
            seconds[name].append(time.perf_counter() - t0)
    return seconds


def ratios_to_first(seconds: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per variant: [median, min, max] over rounds of its time over the first variant's in that round."""
    first = next(iter(seconds.values()))
    return {name: [statistics.median(r), min(r), max(r)]
            for name, r in ((name, [b / a for b, a in zip(s, first)]) for name, s in seconds.items())}


def compare_batch(params, variants: dict, batch: int, prompt: int, steps: int, rounds: int,
                  sampling: Sampling = Sampling()) -> dict:
    """Per variant: median ms/step; per B: median/min/max of its per-round ratio to A, tokens equal to A's.
    Tokens are greedy, or drawn with `sampling` (same seeds for every variant: equal programs draw equal
    tokens)."""
    prompts = [np.asarray(p, np.int32) for p in default_prompts(params.config, [prompt] * batch, seed=batch)]
    carries = {}
    for name in variants:  # prefill under the default tiling: the prefill program is not compared here
        carries[name] = prefill(params, prompts, max_new_tokens=steps * (rounds + WARM_ROUNDS[1]) + 2,
                                sampling=sampling,
                                stop_ids=(), seed=0, cache=CacheSpec())
    finish_compiling()  # the decode program prefill compiles ahead is traced under the default tiling
    programs = {name: v.compile(lambda: _decode.lower(params, carries[name], np.int32(steps)))
                for name, v in variants.items()}

    def call(name):
        carries[name] = programs[name](params, carries[name], np.int32(steps))
        jax.block_until_ready(carries[name].tokens)

    seconds = interleaved({name: (lambda name=name: call(name)) for name in variants}, rounds)
    a = next(iter(variants))
    out = {"batch": batch, "prompt": prompt, "steps": steps, "rounds": rounds,
           "sampling": dataclasses.asdict(sampling), "variants": {}}
    for name, ratio in ratios_to_first(seconds).items():
        same = bool(np.array_equal(np.asarray(carries[name].sequences), np.asarray(carries[a].sequences)))
        out["variants"][name] = {"ms_per_step": 1e3 * statistics.median(seconds[name]) / steps,
                                 "ms_per_call_step": [1e3 * s / steps for s in seconds[name]],
                                 "ratio_to_a": ratio, "tokens_equal_a": same}
    return out


def compare_prefill(params, variants: dict, rows: int, tokens: int, rounds: int) -> dict:
    """Per variant: prompt tokens per second (median over rounds) and the ratio of its call time to A's;
    whether its first token of every row equals A's."""
    prompts, kw = prefill_request(params, rows, tokens)
    p, x, static = prefill_program(params, prompts, **kw)
    programs = {name: v.compile(lambda: _prefill.lower(p, x, **static)) for name, v in variants.items()}
    firsts = {}

    def call(name):  # the inputs are donated: fresh ones each call
        firsts[name] = np.asarray(programs[name](p, prefill_program(params, prompts, **kw)[1]).tokens)

    seconds = interleaved({name: (lambda name=name: call(name)) for name in variants}, rounds)
    a = next(iter(variants))
    return {"rows": rows, "tokens": tokens, "rounds": rounds, "variants": {
        name: {"tok_per_s": rows * tokens / statistics.median(seconds[name]), "ratio_to_a": ratio,
               "tokens_equal_a": bool(np.array_equal(firsts[name], firsts[a]))}
        for name, ratio in ratios_to_first(seconds).items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="NANO_NVFP4")
    ap.add_argument("--batches", default="1,32", help='decode batches to compare ("" for none)')
    ap.add_argument("--tilings", default="", help='B variants, e.g. "bf16_operands=false;decode_ctas_per_sm=4"')
    ap.add_argument("--xla-options", default="",
                    help='B variants, e.g. "xla_gpu_enable_cub_radix_sort=false xla_gpu_enable_command_buffer=FUSION"')
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sampling", default="", help='decode tokens drawn, not greedy, e.g. "temperature=0.8,top_p=0.9"')
    ap.add_argument("--prefill-shapes", default="", help='prefill comparisons after the decode ones, e.g. "1x2048"')
    add_model_args(ap)
    args = ap.parse_args()
    variants = {"default": Variant(),
                **{s: Variant(t) for s, t in zip(filter(None, args.tilings.split(";")), parse_tilings(args.tilings))},
                **{s.strip(): Variant(xla=tuple(o.items()))
                   for s, o in zip(filter(None, (p.strip() for p in args.xla_options.split(";"))),
                                   parse_xla_options(args.xla_options))}}
    if len(variants) < 2:
        ap.error("name at least one B variant: --tilings or --xla-options")
    out_dir, work, cfg, _ = model_setup(args)
    device = jax.devices()[0].device_kind
    md = [f"device {device}, jax {jax.__version__}; model {cfg.pattern} ({cfg.num_layers} layers), bf16, "
          f"{args.layout}, prompt {args.prompt}, {args.rounds} rounds of {args.steps}-step calls", ""]
    checks, tilings = {}, {v.tiling for v in variants.values()}
    gates = {t: with_tiling(t, lambda: gate_line(args.layout, work, Path(args.dims), args.no_gate)) for t in tilings}
    params = random_params(cfg, args.layout, dtype=jnp.bfloat16)
    layer_checks = {t: with_tiling(t, lambda: layer_check_line(params, args.prompt))[1] for t in tilings}
    for name, v in variants.items():
        shared = " (checks compiled without its XLA options)" if v.xla else ""
        checks[name] = f"{gates[v.tiling]} | {layer_checks[v.tiling]}{shared}"
        log(f"[{name}] {checks[name]}")
        md.append(f"- {name}: {checks[name]}")
    md.append("")
    sampling = parse_sampling(args.sampling)
    drawn = f" {args.sampling}" if args.sampling else ""
    legs = [(f"batch {b}{drawn}", "ms_per_step", "{:.3f} ms/step",
             lambda b=b: compare_batch(params, variants, b, args.prompt, args.steps, args.rounds, sampling))
            for b in (int(x) for x in args.batches.split(",") if x)]
    legs += [(f"prefill {rows}x{tokens}", "tok_per_s", "{:.0f} tok/s",
              lambda rows=rows, tokens=tokens: compare_prefill(params, variants, rows, tokens, args.rounds))
             for rows, tokens in parse_shapes(args.prefill_shapes)]
    for what, key, fmt, run in legs:
        r = run()
        r.update(layout=args.layout, device=device, checks=checks)
        with (out_dir / "ab.jsonl").open("a") as f:
            f.write(json.dumps(r) + "\n")
        for name, v in r["variants"].items():
            med, lo, hi = v["ratio_to_a"]
            line = (f"[{args.layout}] {what} {name}: {fmt.format(v[key])}, time x{med:.3f} of default's "
                    f"(rounds x{lo:.3f}-x{hi:.3f}), tokens {'equal to' if v['tokens_equal_a'] else 'DIFFER from'} "
                    f"default's | {checks[name]}")
            log(line)
            md.append(line)
    (out_dir / f"ab-{args.layout}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
