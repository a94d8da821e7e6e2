"""A weight kernel for a hardware-counter profiler (Nsight Compute): one op at Nemotron-3 Nano shapes, called
CALLS times, so that `ncu --launch-skip` can pick warm launches of its Mosaic kernels.

    PYTHONPATH=. ncu --clock-control none -k 'regex:wgemm' --launch-skip 2 --launch-count 2 \\
        python3 benchmarks/counters.py moe32 nvfp4 [--tiling "stages=6"]

Cases: `gemv` (M=1, 2688 -> 10304, a Mamba in_proj at batch 1: one launch a call), `moe1` and `moe32`
(the routed experts of 1 and 32 decode tokens, 6 of 128 experts each: two launches a call, up then
down). The counters say what the timings of kernels.py cannot: achieved occupancy and what limits it
(registers, shared memory), DRAM throughput, the warps' stall reasons. `bash benchmarks/h200.sh
counters` profiles each case and writes one report a case. Random weights, no correctness check: a
diagnostic, not a speed result.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import parse_tilings
from benchmarks.kernels import EXPERTS, FFN, FORMATS, HIDDEN, IN_PROJ, moe_case_inputs
from pallas_kernels import linear, moe_experts
from pallas_kernels._blocked import Tiling

CALLS = 4


def case_fn(case: str, fmt: str, tiling: Tiling, impl: str = "pallas"):
    """(jitted op, its arguments) of one case."""
    make, key = FORMATS[fmt], jax.random.PRNGKey(0)
    if case == "gemv":
        x = jax.random.normal(key, (1, HIDDEN), jnp.float32).astype(jnp.bfloat16)
        return jax.jit(lambda x, w: linear(x, w, impl=impl, tiling=tiling)), (x, make(key, (), IN_PROJ, HIDDEN))
    tokens = {"moe1": 1, "moe32": 32}[case]
    up = make(jax.random.fold_in(key, 1), (EXPERTS,), FFN, HIDDEN)
    down = make(jax.random.fold_in(key, 2), (EXPERTS,), HIDDEN, FFN)
    x, selections = moe_case_inputs(key, 1, tokens)
    op = jax.jit(lambda x, idx, gate, u, d: moe_experts(x, idx, gate, u, d, impl=impl, tiling=tiling))
    return op, (x, *selections[0], up, down)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=("gemv", "moe1", "moe32"))
    ap.add_argument("format", choices=sorted(FORMATS))
    ap.add_argument("--tiling", default="", help='kernel tiling, e.g. "stages=6" (default: the engine\'s)')
    ap.add_argument("--impl", default="pallas", choices=("pallas", "xla"), help="xla: the reference op (any machine)")
    args = ap.parse_args()
    tiling = (parse_tilings(args.tiling) or [Tiling()])[0]
    fn, fn_args = case_fn(args.case, args.format, tiling, args.impl)
    for _ in range(CALLS):
        jax.block_until_ready(fn(*fn_args))
    print(f"{args.case} {args.format} {tiling}: {CALLS} calls")


if __name__ == "__main__":
    main()
