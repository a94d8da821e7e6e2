"""GPU benchmark of pallas_kernels at Nemotron-3 Nano shapes: error, median time, GB/s, XLA baselines.

Run on the GPU machine:  PYTHONPATH=. python3 benchmarks/kernels.py [--sweep] [--out DIR]
Cases: NVFP4 / FP8 / bf16 GEMV 2688 -> 10304 (mamba in_proj) at M=1, the same as a prefill GEMM at M=512,
and MoE decode (1 token, 6 of 128 experts, 2688 -> 1856 -> 2688; and 32 tokens, a batch-32 step, which
reads most experts once) with bf16 / FP8 / NVFP4 experts; the MoE floor counts the experts selected.
--only moe2048: the same experts for the 2,048 tokens of a prompt chunk (prefill: compute-bound, so the
row notes TFLOP/s; e.g. --formats bf16 --tilings "moe_block_rows=128"; the fp32 XLA reference is not timed
there: over a prefill's pairs it needs tens of GB).
--only scaling: the M=1 GEMV for growing N, fitted to kernel µs = fixed cost + bytes / rate.
--only splits: each weight kernel of a batch-1 Mamba + MoE layer pair under split-K plans for 2..16 CTAs
per SM (Tiling.decode_ctas_per_sm).

Timing: each jitted call runs the op over R rotated weight copies (or R expert selections), so the
weights are not L2-resident and launch gaps are those of one compiled program; reported time is the
median over reps of wall time / R after warm-up ("op": everything the op launches), and, where CUPTI
works, the Mosaic kernel's own device time ("kernel"). GB/s = bytes of weights the op must read / time.
Errors are max |y - ref| / max |ref| against a float32 (HIGHEST) dequantise-then-dot reference.
--sweep also times alternative tilings of each kernel; the table uses the fastest correct one.
--tilings "tk=128;ctas_per_sm=8,stages=2" times the default tiling and the ones named instead.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.common import hbm_ceiling_gbs, parse_tilings
from pallas_kernels import FP8Weight, NVFP4Weight, dequantize, is_quantized, linear, moe_experts, reference
from pallas_kernels._blocked import TN, Tiling, _plan, blocked_linear, default_tk, row_blocks

HIDDEN, IN_PROJ, EXPERTS, TOPK, FFN = 2688, 10304, 128, 6, 1856
PREFILL_TOKENS = 2048  # --only moe2048: the MoE experts of one prompt chunk
D_INNER, SHARED_FFN = 4096, 3712  # Mamba out_proj input, shared expert width
IMPL = "pallas"
CEILING_ELEMS = 1 << 30  # 2 GiB of bf16 for the HBM ceiling
MAX_REL_ERR = 2e-2


def rand_nvfp4(key, lead, n, k):
    kp, ks, kg = jax.random.split(key, 3)
    packed = jax.random.bits(kp, (*lead, n, k // 2), jnp.uint8)
    block = jax.random.uniform(ks, (*lead, n, k // 16), jnp.float32, 0.05, 4.0).astype(jnp.float8_e4m3fn)
    return NVFP4Weight.from_hf(packed, block, jax.random.uniform(kg, lead, jnp.float32, 0.002, 0.02))


def rand_fp8(key, lead, n, k):
    kd, ks = jax.random.split(key)
    data = jnp.clip(80.0 * jax.random.normal(kd, (*lead, n, k)), -448, 448).astype(jnp.float8_e4m3fn)
    return FP8Weight.from_hf(data, jax.random.uniform(ks, lead, jnp.float32, 0.002, 0.02))


def rand_dense(key, lead, n, k):
    return (0.05 * jax.random.normal(key, (*lead, n, k), jnp.float32)).astype(jnp.bfloat16)


def stream_tk(w):
    """The kernel's default K step for weight w at decode-size blocks of a grid that fills the GPU (the
    experts of a batch-32 step; what a Tiling with tk=None uses there)."""
    if is_quantized(w):
        return default_tk(w.stream()[0].dtype, type(w).K_PER_ELEMENT, 8, True)
    return default_tk(w.dtype, 1, 8, True)


def nbytes(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def wall_us(fn, args, reps):
    """Median wall time of fn(*args) in microseconds, after warm-up."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


_PRINTED_NAMES: list = []


def cupti_timings(fn, args, quiet: bool = False) -> list | None:
    """(kernel name, ms) of every kernel one call of fn(*args) launches (CUPTI), or None where CUPTI is
    unavailable (said unless quiet: the CPU has none)."""
    try:
        from jax.experimental.mosaic.gpu import profiler
        return profiler.measure(fn, aggregate=False)(*args)[1]
    except Exception as exc:  # noqa: BLE001 - report and carry on with wall time only
        if not quiet:
            print(f"  (CUPTI unavailable: {type(exc).__name__}: {str(exc)[:120]})")
        return None


def kernel_us(fn, args, copies):
    """Per-copy device time of the Mosaic kernels in fn (CUPTI), or None where CUPTI is unavailable."""
    timings = cupti_timings(fn, args)
    if not timings:
        return None, None
    mosaic = [ms for name, ms in timings if "wgemm" in name]
    if not _PRINTED_NAMES:
        _PRINTED_NAMES.append(True)
        print("  kernels:", sorted({name[:80] for name, _ in timings}))
    return 1e3 * sum(mosaic) / copies, 1e3 * sum(ms for _, ms in timings) / copies


def max_rel(y, ref):
    y, ref = jnp.asarray(y, jnp.float32), jnp.asarray(ref, jnp.float32)
    if not bool(jnp.isfinite(y).all()):
        return float("inf")
    return float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))


def rotated(op, copies):
    """jit of (x, [w_0..w_R-1]) -> [op(x, w_i)]: one program running the op on R weight copies."""
    return jax.jit(lambda x, ws: [op(x, w) for w in ws[:copies]])


FORMATS = {"nvfp4": rand_nvfp4, "fp8": rand_fp8, "bf16": rand_dense}


EXTRA_TILINGS: list = []  # --tilings: what every case times besides the default (instead of the built-in sweep)


def tilings_to_time(sweep: bool, builtin: list) -> list:
    """The default tiling, then the --tilings ones if given, else (with --sweep) a case's built-in ones."""
    return [Tiling()] + (EXTRA_TILINGS or (builtin if sweep else []))


def matmul_cases(key, sweep, formats):
    """(name, x, weights list, op(x, w, tiling), xla op, bytes per weight, tilings)."""
    cases = []
    op = lambda x, w, t: linear(x, w, impl=IMPL, tiling=t)
    for fmt in formats:
        mk = FORMATS[fmt]
        copies = {"nvfp4": 8, "fp8": 5, "bf16": 3}[fmt]
        ws = [mk(k, (), IN_PROJ, HIDDEN) for k in jax.random.split(jax.random.fold_in(key, len(cases)), copies)]
        for m in (1, 512) if fmt != "bf16" else (1,):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, HIDDEN), jnp.float32).astype(jnp.bfloat16)
            builtin = [Tiling(ptx=False)] + ([Tiling(stages=2), Tiling(tk=2 * stream_tk(ws[0])),
                                              Tiling(decode_ctas_per_sm=4), Tiling(bf16_operands=False)]
                                             if m == 1 else [])
            tilings = tilings_to_time(sweep, builtin)
            cases.append((f"{fmt} linear M={m} {HIDDEN}->{IN_PROJ}", x, ws if m == 1 else ws[:3], op,
                          reference.linear, nbytes(ws[0]), tilings))
    return cases


def ref_matmul(x, w):
    wf = dequantize(w, jnp.float32)
    return jnp.einsum("mk,nk->mn", x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)


def moe_case_inputs(key, copies, tokens):
    """x [T, H], and per copy, for each token, a distinct random set of 6 experts with random weights."""
    x = jax.random.normal(key, (tokens, HIDDEN), jnp.float32).astype(jnp.bfloat16)
    sel = []
    for i in range(copies):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        perms = jax.vmap(lambda k: jax.random.permutation(k, EXPERTS)[:TOPK])(jax.random.split(k1, tokens))
        sel.append((perms.astype(jnp.int32), jax.nn.softmax(jax.random.normal(k2, (tokens, TOPK)))))
    return x, sel


def run_moe(key, sweep, rows, tokens, formats):
    """moe_experts for `tokens` tokens (1: batch-1 decode; 32: a batch-32 step, which touches most experts;
    PREFILL_TOKENS: a prompt's chunk, compute-bound, where the row notes its TFLOP/s) against ragged_dot and
    the XLA reference, per weight format."""
    copies = {1: 8, 32: 4}.get(tokens, 2)
    x, sel = moe_case_inputs(key, copies, tokens)
    ragged_up = rand_dense(jax.random.fold_in(key, 7), (EXPERTS,), HIDDEN, FFN)  # [E, K, N] layout
    ragged_down = rand_dense(jax.random.fold_in(key, 8), (EXPERTS,), FFN, HIDDEN)

    def ragged(x, s, w_up, w_down):
        idx, _ = s
        e = idx.reshape(-1)
        order = jnp.argsort(e)
        sizes = jnp.zeros((EXPERTS,), jnp.int32).at[e].add(1)
        lhs = jnp.repeat(x, TOPK, axis=0)[order]
        h = jnp.square(jnp.maximum(jax.lax.ragged_dot(lhs, w_up, sizes, preferred_element_type=jnp.float32), 0))
        o = jax.lax.ragged_dot(h.astype(jnp.bfloat16), w_down, sizes, preferred_element_type=jnp.float32)
        return jnp.zeros((tokens * TOPK, HIDDEN), jnp.float32).at[order].set(o).reshape(tokens, TOPK, -1).sum(1)

    # Weights are jit arguments (never closed over: that would embed them as constants).
    ragged_fn = jax.jit(lambda x, ss, u, d: [ragged(x, s, u, d) for s in ss])
    ragged_us = wall_us(ragged_fn, (x, sel, ragged_up, ragged_down), 20) / copies
    print(f"  ragged_dot bf16 over all {EXPERTS} experts: {ragged_us:.1f} us", flush=True)
    del ragged_up, ragged_down
    xla_fn = jax.jit(lambda x, ss, u, d: [reference.moe_experts(x, *s, u, d) for s in ss])
    for fmt in formats:
        mk = FORMATS[fmt]
        ku, kd = jax.random.split(jax.random.fold_in(key, len(fmt)))
        up, down = mk(ku, (EXPERTS,), FFN, HIDDEN), mk(kd, (EXPERTS,), HIDDEN, FFN)
        floor_bytes = len(set(sel[0][0].reshape(-1).tolist())) * (nbytes(up) + nbytes(down)) / EXPERTS
        ref = reference.moe_experts(x, *sel[0], up, down)
        if tokens < PREFILL_TOKENS:
            xla_us = wall_us(xla_fn, (x, sel, up, down), 20) / copies
            print(f"  moe {fmt} xla impl: {xla_us:.1f} us", flush=True)
        else:  # the fp32 reference over a prefill's pairs needs tens of GB (ragged_dot above is XLA's figure)
            xla_us = float("nan")
        tilings = tilings_to_time(sweep, [Tiling(ptx=False), Tiling(decode_ctas_per_sm=4), Tiling(stages=2),
                                          Tiling(stages=6), Tiling(tk=2 * stream_tk(up)), Tiling(bf16_operands=False)])
        best = None
        for t in tilings:
            fn = jax.jit(lambda x, ss, u, d, t=t: [moe_experts(x, *s, u, d, impl=IMPL, tiling=t) for s in ss])
            args = (x, sel, up, down)
            try:
                err = max_rel(fn(x, sel[:1] * copies, up, down)[0], ref)
                us = wall_us(fn, args, 20) / copies
                k_us, all_us = kernel_us(fn, args, copies)
            except Exception as exc:  # noqa: BLE001 - a failing variant is reported, not fatal
                print(f"  moe {fmt} {t}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
                continue
            print(f"  moe {fmt} {t}: err {err:.2e} op {us:.1f} us kernel {k_us} all-kernels {all_us}", flush=True)
            if err < MAX_REL_ERR and (best is None or us < best[1]):
                best = (t, us, err, k_us)
        name = f"moe_experts {fmt} T={tokens} top{TOPK}/{EXPERTS} {HIDDEN}->{FFN}->{HIDDEN}"
        extra = f"ragged_dot bf16 all experts {ragged_us:.1f} us"
        if best and tokens >= PREFILL_TOKENS:
            extra += f"; {2 * tokens * TOPK * 2 * HIDDEN * FFN / best[1] / 1e6:.0f} TFLOP/s"
        rows.append(row(name, best, floor_bytes, xla_us, extra=extra))
        del up, down


def row(name, best, weight_bytes, xla_us, extra=""):
    if best is None:
        return dict(name=name, tiling="FAILED", err=float("nan"), us=float("nan"), k_us=None,
                    gbs=float("nan"), xla_us=xla_us, xla_gbs=weight_bytes / (xla_us * 1e3), extra=extra,
                    bytes=weight_bytes)
    t, us, err, k_us = best
    return dict(name=name, tiling=str(t), err=err, us=us, k_us=k_us, gbs=weight_bytes / (us * 1e3),
                xla_us=xla_us, xla_gbs=weight_bytes / (xla_us * 1e3), extra=extra, bytes=weight_bytes)


def run_matmuls(key, sweep, rows, formats):
    for name, x, ws, op, xla, wbytes, tilings in matmul_cases(key, sweep, formats):
        copies = len(ws)
        ref = ref_matmul(x, ws[0])
        xla_us = wall_us(rotated(xla, copies), (x, ws), 20) / copies
        print(f"  {name} xla impl: {xla_us:.1f} us", flush=True)
        best = None
        for t in tilings:
            fn = rotated(lambda x, w, t=t: op(x, w, t), copies)
            try:
                err = max_rel(fn(x, ws)[0], ref)
                us = wall_us(fn, (x, ws), 30) / copies
                k_us, all_us = kernel_us(fn, (x, ws), copies)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name} {t}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
                continue
            print(f"  {name} {t}: err {err:.2e} op {us:.1f} us kernel {k_us} all-kernels {all_us}", flush=True)
            if err < MAX_REL_ERR and (best is None or us < best[1]):
                best = (t, us, err, k_us)
        m = x.shape[0]
        flops = 2 * m * IN_PROJ * HIDDEN
        extra = f"{flops / (best[1] * 1e-6) / 1e12:.0f} TFLOP/s" if best and m > 8 else ""
        rows.append(row(name, best, wbytes, xla_us, extra))


SCALING_N = (1024, 2688, 10304, 41216)
SCALING_BYTES = 256 << 20  # weight copies each size is timed over: past the L2


def run_scaling(key, formats):
    """A kernel's fixed cost against its cost per byte: the M=1 GEMV 2688 -> N for growing N, kernel time
    (CUPTI) and op time per call, then per tiling a least-squares line kernel µs = fixed + bytes / rate."""
    for fmt in formats:
        mk, pts = FORMATS[fmt], collections.defaultdict(list)
        for n in SCALING_N:
            w0 = mk(key, (), n, HIDDEN)
            copies = max(2, -(-SCALING_BYTES // nbytes(w0)))
            ws = [w0] + [mk(k, (), n, HIDDEN) for k in jax.random.split(jax.random.fold_in(key, n), copies - 1)]
            x = jax.random.normal(key, (1, HIDDEN), jnp.float32).astype(jnp.bfloat16)
            for t in tilings_to_time(False, []):
                fn = rotated(lambda x, w, t=t: linear(x, w, impl=IMPL, tiling=t), copies)
                us = wall_us(fn, (x, ws), 20) / copies
                k_us, all_us = kernel_us(fn, (x, ws), copies)
                print(f"  scaling {fmt} M=1 {HIDDEN}->{n} {t}: {nbytes(w0) / 1e6:.2f} MB, op {us:.1f} us, "
                      f"kernel {k_us}, all kernels {all_us}", flush=True)
                if k_us:
                    pts[t].append((nbytes(w0), k_us))
            del ws
        for t, tp in pts.items():
            if len(tp) < 2:
                continue
            mb, mt = statistics.fmean(p[0] for p in tp), statistics.fmean(p[1] for p in tp)
            slope = sum((b - mb) * (k - mt) for b, k in tp) / sum((b - mb) ** 2 for b, _ in tp)
            print(f"  scaling {fmt} {t}: kernel us = {mt - slope * mb:.1f} + bytes / {1e-3 / slope:.0f} GB/s",
                  flush=True)


SPLIT_TARGETS = (2, 4, 6, 8, 12, 16)  # decode_ctas_per_sm values --only splits times


def run_splits(key, formats):
    """Each weight kernel of a batch-1 Mamba + MoE layer pair (one token, so blocks of 8 rows) under the
    split-K plans of SPLIT_TARGETS CTAs per SM, CUPTI kernel time; a plan equal to an earlier one is
    skipped; each plan's error against a float32 reference first. Linear layers: weight copies rotated;
    experts: disjoint selections of one stack."""
    copies = 16
    shapes = (("mamba in_proj", 1, IN_PROJ, HIDDEN), ("mamba out_proj", 1, HIDDEN, D_INNER),
              ("shared up", 1, SHARED_FFN, HIDDEN), ("shared down", 1, HIDDEN, SHARED_FFN),
              ("experts up", TOPK, FFN, HIDDEN), ("experts down", TOPK, HIDDEN, FFN))
    for fmt in formats:
        mk = FORMATS[fmt]
        for name, blocks, n, k in shapes:
            wkey = jax.random.fold_in(key, n * k + blocks)
            if blocks == 1:
                ws = [mk(kk, (1,), n, k) for kk in jax.random.split(wkey, copies)]
                eids = [jnp.zeros((1,), jnp.int32)] * copies
            else:
                ws = [mk(wkey, (EXPERTS,), n, k)] * copies
                perm = jax.random.permutation(wkey, EXPERTS).astype(jnp.int32)
                eids = [jnp.roll(perm, -i * blocks)[:blocks] for i in range(copies)]
            # up projections: every block reads the token's row; down: each expert its own row
            rows_in = blocks if name == "experts down" else 1
            xb = jnp.concatenate([row_blocks(jax.random.normal(jax.random.fold_in(key, r), (1, k), jnp.float32)
                                             .astype(jnp.bfloat16), 8) for r in range(rows_in)])
            x_rows = jnp.broadcast_to(xb[:, 0].astype(jnp.float32), (blocks, k))
            ref = jnp.einsum("bk,bnk->bn", x_rows, dequantize(ws[0], jnp.float32)[eids[0]],
                             precision=jax.lax.Precision.HIGHEST)
            fmt_class = type(ws[0]) if is_quantized(ws[0]) else None
            stream_dtype = (ws[0].stream()[0] if fmt_class else ws[0]).dtype
            plans = set()
            for c in SPLIT_TARGETS:
                t = Tiling(decode_ctas_per_sm=c)
                tk, splits, _, _ = _plan(fmt_class, stream_dtype, k, 8, n // TN, blocks, t)
                if (tk, splits) in plans:
                    continue
                plans.add((tk, splits))
                fn = jax.jit(lambda xb, ws, eids, t=t: [blocked_linear(xb, e, w, IMPL, t) for w, e in zip(ws, eids)])
                err = max_rel(fn(xb, ws, eids)[0][:, 0], ref)
                us = wall_us(fn, (xb, ws, eids), 10) / copies
                k_us, all_us = kernel_us(fn, (xb, ws, eids), copies)
                print(f"  splits {fmt} {name} {blocks}x{n}x{k} decode_ctas_per_sm={c}: tk={tk} splits={splits} "
                      f"CTAs={n // TN * blocks * splits}: err {err:.1e}, op {us:.1f} us, kernel {k_us}, "
                      f"all kernels {all_us}", flush=True)
            del ws


def table(rows, device, ceiling):
    lines = [f"device: {device}; HBM ceiling (2 GiB bf16: best of a read and an in-place scale): "
             f"{ceiling:.0f} GB/s", "",
             "| case | max rel err | op time (us) | kernel time (us) | GB/s (op) | XLA impl (us) | XLA GB/s | notes | tiling |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        k_us = f"{r['k_us']:.1f}" if r["k_us"] else "n/a"
        floor = r["bytes"] / (ceiling * 1e3)
        lines.append(f"| {r['name']} | {r['err']:.1e} | {r['us']:.1f} | {k_us} | {r['gbs']:.0f} | "
                     f"{r['xla_us']:.1f} | {r['xla_gbs']:.0f} | bytes {r['bytes'] / 1e6:.1f} MB, floor "
                     f"{floor:.1f} us; {r['extra']} | {r['tiling']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time alternative tilings")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for kernels.md")
    parser.add_argument("--only", default="", help="comma list: matmul,moe (both below),moe1,moe32,moe2048,scaling,"
                                                   "splits")
    parser.add_argument("--formats", default="bf16,fp8,nvfp4", help="comma list of weight formats")
    parser.add_argument("--tilings", default="", help='tilings to time besides the default, e.g. "tk=128;ctas_per_sm=8"')
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU check)")
    args = parser.parse_args()
    if args.smoke:
        global HIDDEN, IN_PROJ, EXPERTS, FFN, IMPL, CEILING_ELEMS, SCALING_N, SCALING_BYTES, D_INNER, SHARED_FFN
        global PREFILL_TOKENS
        HIDDEN, IN_PROJ, EXPERTS, FFN, IMPL, CEILING_ELEMS = 128, 128, 8, 64, "interpret", 1 << 20
        PREFILL_TOKENS = 96
        D_INNER, SHARED_FFN = 128, 128
        SCALING_N, SCALING_BYTES = (64, 128), 1 << 14
    EXTRA_TILINGS[:] = parse_tilings(args.tilings)
    device = jax.devices()[0].device_kind
    print("device:", device, "| jax", jax.__version__, flush=True)
    ceiling = hbm_ceiling_gbs(CEILING_ELEMS)
    print(f"HBM ceiling {ceiling:.0f} GB/s", flush=True)
    key, rows = jax.random.key(0), []
    only = set(filter(None, args.only.split(","))) or {"matmul", "moe"}
    asked = set(filter(None, args.formats.split(",")))
    if asked - set(FORMATS):
        parser.error(f"--formats: unknown {sorted(asked - set(FORMATS))}; choose from {list(FORMATS)}")
    formats = [f for f in FORMATS if f in asked]
    if "matmul" in only:
        run_matmuls(key, args.sweep, rows, formats)
    if "scaling" in only:
        run_scaling(key, formats)
    if "splits" in only:
        run_splits(key, formats)
    for tokens in (1, 32, PREFILL_TOKENS):
        if f"moe{tokens}" in only or ("moe" in only and tokens < PREFILL_TOKENS):
            run_moe(key, args.sweep, rows, tokens, formats)
    text = table(rows, device, ceiling)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write(text + "\n")
    return 0 if all(r["tiling"] != "FAILED" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
