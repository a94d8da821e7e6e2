"""Decode benchmark: gate a configuration against the transformers oracle, then time nemoh's decode.

    python benchmarks/decode.py --pattern "M*E" --dims nano --out results.md

Builds a random checkpoint at the chosen widths through the oracle worker (transformers, CPU),
runs the token gate on it (nemoh on this machine's default device vs transformers), then times
batch-1 decode: `decode(params, carry, steps)` with block_until_ready after a warm-up call, median
over repeats, reported as ms/token. A timing is printed only next to its configuration's gate line.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nemoh  # noqa: E402
from nemoh import oracle  # noqa: E402
from nemoh.engine.decode import decode  # noqa: E402
from nemoh.engine.kv_pages import CacheSpec  # noqa: E402
from nemoh.engine.prefill import prefill  # noqa: E402
from nemoh.engine.sampling import Sampling  # noqa: E402
from nemoh.gate import compare, default_prompts  # noqa: E402

NANO_DIMS = Path(__file__).parent / "nano_dims.json"  # Nemotron-3 Nano config.json minus its layer layout


def config_for(dims_file: Path, pattern: str) -> dict:
    dims = json.loads(Path(dims_file).read_text())
    return {**dims, "hybrid_override_pattern": pattern, "time_step_min": 1e-7, "time_step_floor": 1e-4}


def time_decode(params, prompt_len: int, steps: int, repeats: int) -> tuple[float, float]:
    """(median ms/token over `repeats` calls of `steps` steps, first-call seconds incl. compile)."""
    prompt = [list(range(1, prompt_len + 1))]
    total = steps * (repeats + 1) + 1
    carry = prefill(params, [np.asarray(p, np.int32) for p in prompt], max_new_tokens=total, sampling=Sampling(),
                    stop_ids=(), seed=0, cache=CacheSpec())
    t0 = time.perf_counter()
    carry = decode(params, carry, steps)
    jax.block_until_ready(carry.tokens)
    first = time.perf_counter() - t0
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = decode(params, carry, steps)
        jax.block_until_ready(carry.tokens)
        per.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(per), first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pattern", default="M*E")
    ap.add_argument("--dims", default=str(NANO_DIMS), help="config.json fields giving the widths")
    ap.add_argument("--quant", default="none", choices=["none", "NVFP4", "FP8", "NANO_NVFP4", "NANO_FP8"])
    ap.add_argument("--workdir", default="/tmp/nemoh-bench")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(args.workdir)
    dense = work / f"dense-{args.pattern.replace('*', 'A')}"
    if not (dense / "config.json").exists():
        oracle.make_checkpoints([dict(config=config_for(args.dims, args.pattern), out_dir=str(dense), seed=0,
                                      dtype="float32", layout_spelling="pattern")])
    model_dir, oracle_dir = dense, dense
    if args.quant != "none":
        from nemoh.io.dequantize import dequantize_checkpoint
        from nemoh.io.quantize import quantize_checkpoint

        model_dir, oracle_dir = work / f"{dense.name}-{args.quant}", work / f"{dense.name}-{args.quant}-dq"
        if not (model_dir / "config.json").exists():
            quantize_checkpoint(dense, model_dir, args.quant)
            dequantize_checkpoint(model_dir, oracle_dir, dtype="float32")
    cfg = nemoh.NemotronHConfig.from_json_file(dense / "config.json")
    prompts = default_prompts(cfg, [5, 40], seed=0)
    ref = [r["tokens"] for r in oracle.greedy([dict(model_dir=str(oracle_dir), prompts=prompts,
                                                    max_new_tokens=args.new_tokens, stop_token_ids=[],
                                                    dtype="float32")])[0]]
    lines = [f"device: {jax.devices()[0].device_kind}; pattern {args.pattern!r}, widths from {Path(args.dims).name}; quant {args.quant}"]
    for dtype in (jnp.float32, jnp.bfloat16):
        params = nemoh.load(model_dir, dtype=dtype)
        ours = nemoh.generate(params, prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
        gate = compare(ours, ref).line()
        ms, first = time_decode(params, 64, args.steps, args.repeats)
        lines.append(f"{jnp.dtype(dtype).name}: {gate} | decode batch 1: {ms:.3f} ms/token "
                     f"(median of {args.repeats} x {args.steps} steps; first call {first:.1f} s incl. compile)")
        del params
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
