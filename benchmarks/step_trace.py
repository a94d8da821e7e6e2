"""One decode step (or one prefill call), kernel by kernel: each launch in order with its device time, the
idle gap before it, its layer scope and the HLO ops XLA fused into it. Where the per-kind breakdown of
benchmarks/profile.py says how much, this says which launches to remove and where the GPU waits.

    PYTHONPATH=. python3 benchmarks/step_trace.py [--layout NANO_NVFP4] [--pattern MEME] [--batch 1]
        [--steps 8] [--prefill ROWSxTOKENS] [--tiling "bf16_operands=false"] [--graphs] [--out DIR]

Random params at Nano widths with the given (short) layer pattern, built on the device; a profiled
decode call of `steps` steps, whose middle step's launches are printed and written to
step-trace-<layout>-b<batch>.txt in --out, beside the compiled program's HLO text; with --prefill (e.g.
1x2048) every launch of one prefill call of that many prompts and tokens instead
(step-trace-<layout>-prefill<ROWSxTOKENS>.txt). The report ends with the idle time between launches by
gap size and the largest gaps with the launches around them and what the host was doing meanwhile (its
innermost Python calls and XLA runtime annotations covering the gap). Ungated: a diagnostic, not a speed
result.
Under a profiler XLA launches a program's kernels one by one unless told otherwise; --graphs keeps its
CUDA graphs, so the trace shows the execution that timed calls get.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import nano_config, parse_tilings
from benchmarks.profile import _norm, attribute, traced_events
from benchmarks.prefill import parse_shapes, prefill_hlo, prefill_request
from nemoh.engine.decode import _decode, decode, finish_compiling
from nemoh.engine.kv_pages import CacheSpec
from nemoh.engine.prefill import prefill
from nemoh.engine.sampling import Sampling
from nemoh.gate import default_prompts
from nemoh.random_params import random_params
from pallas_kernels import _blocked

_COMPUTATION = re.compile(r"^%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_OPCODE = re.compile(r"=\s*(?:\([^=]*\)|\S+)\s+([\w\-]+)\(")
_CALLS = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*\b(?:fusion|custom-call)\(")
_CALLEE = re.compile(r"calls=%?([\w.\-]+)")


def fused_ops(hlo_text: str) -> dict[str, str]:
    """Normalised fusion instruction name -> a summary of the opcodes of the computation it calls
    ("reduce, multiply x3, convert"); custom calls -> their output shape."""
    bodies: dict[str, collections.Counter] = {}
    current = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = bodies.setdefault(head.group(1), collections.Counter())
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None:
            op = _OPCODE.search(line)
            if op and op.group(1) not in ("parameter", "constant", "bitcast", "get-tuple-element", "tuple"):
                current[op.group(1)] += 1
    out = {}
    for line in hlo_text.splitlines():
        m = _CALLS.match(line)
        if not m:
            continue
        name, callee = m.group(1), _CALLEE.search(line)
        if callee and callee.group(1) in bodies:
            ops = bodies[callee.group(1)]
            out[_norm(name)] = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in ops.most_common(8))
        elif "custom-call" in line:
            shape = line.split("=", 1)[1].split("custom-call", 1)[0].strip()
            out[_norm(name)] = f"custom-call {shape[:60]}"
    return out


def trace(params, batch: int, steps: int, prompt: int = 64):
    """(events of one middle decode step in launch order, scopes, the compiled decode HLO text, the host
    events of the call)."""
    cfg = params.config
    prompts = [np.asarray(p, np.int32) for p in default_prompts(cfg, [prompt] * batch, seed=batch)]
    carry = prefill(params, prompts, max_new_tokens=5 * steps + 4, sampling=Sampling(), stop_ids=(), seed=0,
                    cache=CacheSpec())
    # Compile for the HLO text first: XLA clears every program's recorded CUDA graphs when it loads one, and
    # the first run after that records them again (a whole loop recorded as one graph runs op by op then).
    hlo = _decode.lower(params, carry, np.int32(steps)).compile().as_text()
    for _ in range(2):
        carry = decode(params, carry, steps)
    jax.block_until_ready(carry.tokens)
    events, host, _ = traced_events(lambda: jax.block_until_ready(decode(params, carry, steps).tokens))
    per_step = len(events) // steps
    middle = events[per_step * (steps // 2): per_step * (steps // 2 + 1)]
    scopes, _ = attribute(middle, hlo)
    return middle, scopes, hlo, host


def trace_prefill(params, rows: int, tokens: int):
    """(events of one prefill call of `rows` prompts of `tokens` tokens in launch order, scopes, the compiled
    prefill HLO text, the call's host events), after two untimed calls (the first compiles; the decode
    program it starts compiling is finished before the profiled call)."""
    prompts, kw = prefill_request(params, rows, tokens)
    run = lambda: jax.block_until_ready(prefill(params, prompts, **kw).tokens)
    hlo = prefill_hlo(params, prompts, kw)
    for _ in range(2):
        run()
    finish_compiling()
    events, host, _ = traced_events(run)
    scopes, _ = attribute(events, hlo)
    return events, scopes, hlo, host


GAP_BINS_US = (5, 50)  # idle gaps summed under, between and over these bounds
LARGEST_GAPS = 12


def gaps_before(events) -> list[float]:
    """µs from the end of each launch to the start of the next: one per launch after the first."""
    return [(start - (prev_start + prev_dur)) / 1e3
            for (_, prev_dur, prev_start, *_), (_, _, start, *_) in zip(events, events[1:])]


def host_during(host, start_ns: float, end_ns: float, most: int = 3) -> str:
    """What the host was doing while the GPU idled from start_ns to end_ns: the innermost (shortest) host
    events, of distinct names, that each cover at least half of that time, as "name (thread) µs"."""
    half = (end_ns - start_ns) / 2
    covering = sorted((dur, name, thread) for name, dur, start, thread in host
                      if half > 0 and min(start + dur, end_ns) - max(start, start_ns) >= half)
    picked = []
    for dur, name, thread in covering:
        if len(picked) < most and all(name != p[1] for p in picked):
            picked.append((dur, name, thread))
    return "; ".join(f"{name[:60]} ({thread[:24]}) {dur / 1e3:.0f} µs" for dur, name, thread in picked)


def gap_summary(events, scopes, host=()) -> list[str]:
    """Idle time between consecutive launches by gap size, and the largest gaps with the launches either side
    (which op the GPU waited after: a device-to-host copy, a loop's predicate, a conditional) and what the
    host was doing meanwhile (host_during; host: the call's host events)."""
    gaps = [(g, i) for i, g in enumerate(gaps_before(events), start=1)]
    low, high = GAP_BINS_US
    bins = [sum(g for g, _ in gaps if g > 0 and g < low), sum(g for g, _ in gaps if low <= g < high),
            sum(g for g, _ in gaps if g >= high)]
    lines = ["", f"idle between launches: under {low} µs {bins[0]:.1f} µs, {low}-{high} µs {bins[1]:.1f} µs "
             f"({sum(low <= g < high for g, _ in gaps)} gaps), over {high} µs {bins[2]:.1f} µs "
             f"({sum(g >= high for g, _ in gaps)} gaps)", "",
             "| gap µs | after # (scope: kernel) | before # (scope: kernel) | host meanwhile |", "|---|---|---|---|"]
    for g, i in sorted(gaps, reverse=True)[:LARGEST_GAPS]:
        (_, dur, start, *_), (_, _, next_start, *_) = events[i - 1], events[i]
        lines.append(f"| {g:.1f} | {i - 1} ({scopes[i - 1]}: {events[i - 1][0][:40]}) | {i} ({scopes[i]}: "
                     f"{events[i][0][:40]}) | {host_during(host, start + dur, next_start)} |")
    return lines


def report(events, scopes, hlo: str, host=()) -> str:
    ops = fused_ops(hlo)
    lines = [f"{len(events)} launches, {sum(e[1] for e in events) / 1e3:.1f} µs of kernels, "
             f"{(events[-1][2] + events[-1][1] - events[0][2]) / 1e3:.1f} µs first start to last end" if events else
             "no kernel events", "", "| # | scope | kernel | µs | gap before µs | fused ops / grid |", "|---|---|---|---|---|---|"]
    gaps = [""] + [f"{g:.1f}" for g in gaps_before(events)]
    for i, ((name, dur, _, grid, _), scope, gap) in enumerate(zip(events, scopes, gaps)):
        what = f"grid {grid}" if grid and "mosaic" in name else ops.get(_norm(name), "")
        lines.append(f"| {i} | {scope} | {name[:48]} | {dur / 1e3:.1f} | {gap} | {what} |")
    by_scope = collections.Counter(scopes)
    lines += ["", "launches by scope: " + ", ".join(f"{k} {v}" for k, v in by_scope.most_common())]
    return "\n".join(lines + (gap_summary(events, scopes, host) if len(events) > 1 else []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="NANO_NVFP4")
    ap.add_argument("--pattern", default="MEME")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", default="", help="trace one prefill call of ROWSxTOKENS (e.g. 1x2048) instead of decode")
    ap.add_argument("--tiling", default="", help='kernel tiling for every Pallas op, e.g. "bf16_operands=false"')
    ap.add_argument("--graphs", action="store_true",
                    help="keep XLA's command buffers (CUDA graphs) under the profiler, as timed calls run; XLA "
                    "otherwise launches a profiled program op by op")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.graphs:  # read when the backend starts, which nothing above has done yet
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_enable_command_buffers_during_profiling=true"
    if args.tiling:
        (_blocked.DEFAULT_TILING,) = parse_tilings(args.tiling)
    cfg = nano_config(args.pattern)
    params = random_params(cfg, args.layout, dtype=jnp.bfloat16)
    if args.prefill:
        ((rows, tokens),) = parse_shapes(args.prefill)
        events, scopes, hlo, host = trace_prefill(params, rows, tokens)
        what, name = f"prefill {args.prefill}", f"{args.layout}-prefill{args.prefill}"
    else:
        events, scopes, hlo, host = trace(params, args.batch, args.steps)
        what, name = f"decode batch {args.batch}", f"{args.layout}-b{args.batch}"
    text = report(events, scopes, hlo, host)
    print(f"{jax.devices()[0].device_kind} | {args.layout} {args.pattern} {what} | tiling "
          f"{args.tiling or 'default'} | {'CUDA graphs' if args.graphs else 'op by op (XLA under a profiler)'}")
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiling:
        name += "-" + args.tiling.replace("=", "").replace(",", "-")
    if args.graphs:
        name += "-graphs"
    (out / f"step-trace-{name}.txt").write_text(text + "\n")
    (out / f"hlo-{name}.txt").write_text(hlo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
