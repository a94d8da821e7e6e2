"""Where compile time goes: the prefill and decode programs at Nano dims, under sets of XLA flags.

    PYTHONPATH=. python3 benchmarks/compile.py [--layout NANO_NVFP4] [--variants default,autotune0]
        [--batch 1] [--prompt 128] [--steps 32] [--pattern P] [--dims JSON] [--tiling T] [--out DIR]
    PYTHONPATH=. python3 benchmarks/compile.py --lower-only 1,32 [--tiling T]   # any machine, the CPU too

--tiling: the kernel tiling every Pallas op takes (e.g. "lane_lowering=false"), in every variant.

Each variant runs in a fresh process (XLA reads its flags once) with the persistent compilation cache
off. Per variant: for `batch` prompts of `prompt` tokens (a decode batch of more than 8 rows holds XLA
GEMMs, whose Triton configs are autotuned, where batch 1 has none), trace + lowering and XLA compile
seconds of each program, timed separately; the host
events of the profiled decode compile summed by name (XLA's passes, autotuning, the Mosaic GPU kernels'
compiles; nested events count in each enclosing one); the number of Mosaic GPU kernel calls in each
program and how many of them are distinct; then decode ms per step with that program (median of 3
calls of --steps steps; ungated: a flag that only changes compile choices keeps the numerics, and the
gated legs of benchmarks/decode.py measure whatever becomes the default).
Results: compile.jsonl in --out, one line per variant.

--lower-only BATCHES runs on any machine, a CPU one included: for each batch size, the seconds to trace
and to lower the prefill program (prompts of --prompt tokens) and the decode program for the GPU ("cuda",
with the Pallas kernels; abstract params, so no weights are built), which is the Python part of their
compiles (Mosaic GPU lowers each distinct kernel in Python), and the Mosaic kernels in the decode module.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import NANO_DIMS, NANO_PATTERN, parse_tilings, wall_s

VARIANTS = {
    "default": "",
    "autotune0": "--xla_gpu_autotune_level=0",
    "serial": "--xla_gpu_force_compilation_parallelism=1",
}
_MOSAIC = re.compile(r'custom_call_target="mosaic_gpu[^"]*"(.*)')
_METADATA = re.compile(r"metadata=\{[^}]*\}")


def mosaic_calls(hlo_text: str) -> tuple[int, int]:
    """(Mosaic GPU kernel calls, distinct kernels among them) in a compiled program's HLO text."""
    calls = [_METADATA.sub("", m) for m in _MOSAIC.findall(hlo_text)]
    return len(calls), len(set(calls))


def host_events(trace_dir: str, top: int = 30) -> list[dict]:
    """The host-side events of a profiled compile, seconds summed by name, the longest first."""
    from jax.profiler import ProfileData

    totals, counts = collections.Counter(), collections.Counter()
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                for ev in line.events:
                    if ev.name.startswith("$"):  # Python frames
                        continue
                    totals[ev.name] += ev.duration_ns / 1e9
                    counts[ev.name] += 1
    return [{"event": name, "s": round(s, 3), "count": counts[name]} for name, s in totals.most_common(top)]


def prefill_inputs(params, prompts, max_new_tokens: int):
    """(params, PrefillInputs, static args) of a greedy prefill of `prompts` on one device, as prefill
    would build them."""
    from nemoh.engine.kv_pages import CacheSpec
    from nemoh.engine.prefill import prefill_program
    from nemoh.engine.sampling import Sampling

    return prefill_program(params, prompts, max_new_tokens=max_new_tokens, sampling=Sampling(), stop_ids=(), seed=0,
                           cache=CacheSpec(), prefill_chunk=None, mesh=None, rules=None)


def lowering(layout: str, batches: list[int], prompt: int, pattern: str, dims: str) -> list[dict]:
    """Per batch size: seconds to trace and to lower the prefill and decode programs for the GPU, in this
    process, whatever its backend; params are abstract (jax.eval_shape) but for the embedding, whose
    device the request planning reads."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import nano_config
    from nemoh.engine.decode import _decode
    from nemoh.engine.prefill import _prefill
    from nemoh.gate import default_prompts
    from nemoh.random_params import random_params
    from pallas_kernels import default_impl

    cfg = nano_config(pattern, dims=Path(dims))
    params = jax.eval_shape(lambda: random_params(cfg, layout, dtype=jnp.bfloat16))
    params = dataclasses.replace(params, embed=jnp.zeros(params.embed.shape, params.embed.dtype))
    out = []
    for batch in batches:
        prompts = [np.asarray(p, np.int32) for p in default_prompts(cfg, [prompt] * batch, seed=1)]
        p, x, static = prefill_inputs(params, prompts, prompt + 2)
        with default_impl("pallas"):
            jax.clear_caches()  # nothing of an earlier batch's lowering is reused
            t0 = time.perf_counter()
            traced = _prefill.trace(p, x, **static)
            t1 = time.perf_counter()
            traced.lower(lowering_platforms=("cuda",))
            t2 = time.perf_counter()
            carry = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), traced.out_info)
            jax.clear_caches()
            t3 = time.perf_counter()
            traced = _decode.trace(p, carry, np.int32(1))
            t4 = time.perf_counter()
            module = traced.lower(lowering_platforms=("cuda",)).as_text()
            t5 = time.perf_counter()
        out.append({"batch": batch, "prefill_trace_s": t1 - t0, "prefill_lower_s": t2 - t1, "trace_s": t4 - t3,
                    "lower_s": t5 - t4, "mosaic_kernels": module.count("@mosaic_gpu")})
    return out


def measure(layout: str, batch: int, prompt: int, steps: int, pattern: str, dims: str) -> dict:
    """In this process: build the params, lower and compile both programs, time decode."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import nano_config
    from nemoh.compile_cache import set_compilation_cache
    from nemoh.engine.decode import _decode
    from nemoh.engine.prefill import _prefill
    from nemoh.gate import default_prompts
    from nemoh.random_params import random_params

    set_compilation_cache(None)  # compile, never load from a cache
    cfg = nano_config(pattern, dims=Path(dims))
    params = random_params(cfg, layout, dtype=jnp.bfloat16)
    prompts = [np.asarray(p, np.int32) for p in default_prompts(cfg, [prompt] * batch, seed=1)]
    params, x, static = prefill_inputs(params, prompts, steps * 4 + 2)
    out = {}
    t0 = time.perf_counter()
    lowered = _prefill.lower(params, x, **static)
    t1 = time.perf_counter()
    program = lowered.compile()
    t2 = time.perf_counter()
    out["prefill"] = {"lower_s": t1 - t0, "compile_s": t2 - t1, "mosaic_calls": mosaic_calls(program.as_text())}
    carry = program(params, x)
    t0 = time.perf_counter()
    lowered = _decode.lower(params, carry, np.int32(steps))
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace):
            program = lowered.compile()
        t2 = time.perf_counter()
        out["decode"] = {"lower_s": t1 - t0, "compile_s": t2 - t1, "mosaic_calls": mosaic_calls(program.as_text()),
                         "host_events": host_events(trace)}
    holder = [carry]

    def run():
        holder[0] = program(params, holder[0], np.int32(steps))
        jax.block_until_ready(holder[0].tokens)

    run()  # first run: kernels load
    out["decode_ms_per_step_ungated"] = 1e3 * statistics.median(wall_s(run, 3)) / steps
    out["device"] = jax.devices()[0].device_kind
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="NANO_NVFP4")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"names from {sorted(VARIANTS)}")
    ap.add_argument("--batch", type=int, default=1, help="prompts, the decode batch")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--pattern", default=NANO_PATTERN, help="layer pattern (default: Nano's 52)")
    ap.add_argument("--dims", default=str(NANO_DIMS), help="config.json fields giving the widths (default: Nano's)")
    ap.add_argument("--lower-only", default="", metavar="BATCHES",
                    help="only trace and lower the decode program for the GPU at these batch sizes (any machine)")
    ap.add_argument("--tiling", default="", help='kernel tiling of every Pallas op, e.g. "lane_lowering=false"')
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiling:
        from pallas_kernels import _blocked

        (_blocked.DEFAULT_TILING,) = parse_tilings(args.tiling)
    tiling_label = f", tiling {args.tiling}" if args.tiling else ""
    if args.lower_only:
        for r in lowering(args.layout, [int(b) for b in args.lower_only.split(",")], args.prompt, args.pattern,
                          args.dims):
            print(f"{args.layout} batch {r['batch']}{tiling_label}: prefill of {args.prompt} tokens a prompt trace "
                  f"{r['prefill_trace_s']:.2f} s, lower for the GPU {r['prefill_lower_s']:.2f} s; decode trace "
                  f"{r['trace_s']:.2f} s, lower for the GPU "
                  f"{r['lower_s']:.2f} s, {r['mosaic_kernels']} Mosaic kernels in the module", flush=True)
        return 0
    if args.child:
        print(json.dumps(measure(args.layout, args.batch, args.prompt, args.steps, args.pattern, args.dims)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.variants.split(","):
        flags = VARIANTS[name]
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        cmd = [sys.executable, __file__, "--child", "--layout", args.layout, "--batch", str(args.batch),
               "--prompt", str(args.prompt), "--steps", str(args.steps), "--pattern", args.pattern, "--dims", args.dims,
               "--tiling", args.tiling]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"{name}: FAILED rc={done.returncode}: {done.stderr[-1500:]}", flush=True)
            continue
        r = {"variant": name, "xla_flags": flags, "tiling": args.tiling or "default", "layout": args.layout,
             "batch": args.batch,
             **json.loads(done.stdout.splitlines()[-1])}
        with (out / "compile.jsonl").open("a") as f:
            f.write(json.dumps(r) + "\n")
        p, d = r["prefill"], r["decode"]
        print(f"{name} ({flags or 'no flags'}{tiling_label}), batch {args.batch}: "
              f"prefill lower {p['lower_s']:.1f} s "
              f"compile {p['compile_s']:.1f} s (Mosaic calls {p['mosaic_calls']}); decode lower {d['lower_s']:.1f} s "
              f"compile {d['compile_s']:.1f} s (Mosaic calls {d['mosaic_calls']}); "
              f"decode {r['decode_ms_per_step_ungated']:.3f} ms/step ungated",
              flush=True)
        for ev in d["host_events"][:15]:
            print(f"    {ev['s']:8.2f} s  x{ev['count']:<6} {ev['event'][:110]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
