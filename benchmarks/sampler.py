"""The sampler alone at a real vocabulary: nemoh's sample() per setting, timed, after its top-k / top-p
cut is checked in the same run against the rule written with a sort in float64 (kept_by_rule, which
tests/test_sampling.py's property test uses too). A row whose last kept entry's mass-ahead lies within
BOUNDARY of top_p is reported as at the boundary, not failed: float32 sums of 131,072 terms decide its side.
"sorted cut alone" times the cut as the sorting sampler nemoh had before found it (sorted_cut).

    PYTHONPATH=. python3 benchmarks/sampler.py --batches 1,8,32 --vocab 131072

Each timing runs 50 calls in one compiled loop (no dispatch per call), best of 5. Results are printed
and appended to $OUT/sampler.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import wall_s
from nemoh.engine.sampling import SamplingState, _cut, sample

SETTINGS = {"greedy": (0.0, None, 1.0), "t=0.8": (0.8, None, 1.0), "t=0.8 top_p=0.9": (0.8, None, 0.9),
            "t=0.8 top_k=50 top_p=0.9": (0.8, 50, 0.9)}


def loop_us(fn, *args, iters: int = 50) -> float:
    """µs per call of fn(*args, i), iters calls in one fori_loop, best of 5 timed runs."""
    run = jax.jit(lambda *a: jax.lax.fori_loop(0, iters, lambda i, acc: acc + fn(*a, i).astype(jnp.float32).sum(), 0.0))
    jax.block_until_ready(run(*args))
    return min(wall_s(lambda: jax.block_until_ready(run(*args)), 5)) / iters * 1e6


BOUNDARY = 1e-5  # a row whose mass-ahead lies this close to top_p: float32 sums decide its side


def kept_by_rule(x: np.ndarray, k: int, p: float) -> tuple[int, float]:
    """The rule written out with a sort, in float64, for one row x [V] (top_k k, V or more: no limit):
    how many entries top-k then top-p keep (ties at the cut included), and the distance of the
    mass-ahead nearest top_p from it (x with max 0, as the sampler's rows are)."""
    k = min(k, x.shape[-1])
    desc = -np.sort(-x.astype(np.float64))
    probs = np.exp(desc[:k])
    probs /= probs.sum()
    ahead = np.cumsum(probs) - probs
    rank = k if p >= 1 else int(np.sum(ahead < p))
    margin = np.inf if p >= 1 else np.min(np.abs(ahead - p))
    return int(np.sum(x >= desc[rank - 1])), margin


def sorted_cut(x, top_k, top_p):
    """The cut as a sort finds it (the sorting sampler's): the last value kept by top-k, then the nucleus
    of their mass, in float32; timed against _cut."""
    desc = -jnp.sort(-x, axis=-1)
    rank = jnp.arange(x.shape[-1])[None, :]
    in_k = rank < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    ahead = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.sum(in_k & ((ahead < top_p[:, None]) | (top_p[:, None] >= 1)), axis=-1)
    return jnp.take_along_axis(desc, kept[:, None] - 1, axis=-1)[:, 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].device_kind
    failed = False
    for b in (int(v) for v in args.batches.split(",")):
        rng = np.random.default_rng(b)
        logits = jnp.asarray(rng.standard_normal((b, args.vocab)) * 3, jnp.float32)
        x = logits * jnp.asarray(rng.choice([0.3, 1.0, 3.0], (b, 1)), jnp.float32)
        x = x - x.max(-1, keepdims=True)
        k = jnp.asarray(rng.integers(1, args.vocab + 1, b), jnp.int32)
        p = jnp.asarray(rng.choice([0.5, 0.9, 0.99, 1.0], b), jnp.float32)
        cut = np.asarray(jax.jit(_cut)(x, k, p))
        xs, ks, ps = np.asarray(x), np.asarray(k), np.asarray(p)
        agree, boundary = 0, 0
        for row in range(b):
            kept, margin = kept_by_rule(xs[row], int(ks[row]), float(ps[row]))
            if margin <= BOUNDARY:
                boundary += 1
            else:
                agree += int(np.sum(xs[row] >= cut[row])) == kept
        failed |= agree + boundary != b
        record = {"device": device, "batch": b, "vocab": args.vocab, "cut_rows_agreeing": agree,
                  "rows_at_boundary": boundary, "us": {}}
        print(f"[{device}] batch {b}: cut keeps what the float64 rule keeps on {agree}/{b - boundary} rows, "
              f"{boundary} within {BOUNDARY:g} of top_p ({'PASS' if agree + boundary == b else 'FAIL'})", flush=True)
        step = jnp.zeros((b,), jnp.int32)
        for name, (t, top_k, top_p) in SETTINGS.items():
            s = SamplingState(temperature=jnp.full((b,), t, jnp.float32),
                              top_k=jnp.full((b,), top_k or args.vocab, jnp.int32),
                              top_p=jnp.full((b,), top_p, jnp.float32), keys=jnp.zeros((b, 2), jnp.uint32))
            record["us"][f"sample {name}"] = loop_us(lambda l, s, i: sample(l + i, s, step), logits, s)
        k50, p90 = jnp.full((b,), 50, jnp.int32), jnp.full((b,), 0.9, jnp.float32)
        shifted = lambda v, i: v - i.astype(jnp.float32) * 1e-3  # noqa: E731 (no loop-invariant input to hoist)
        record["us"]["cut alone"] = loop_us(lambda v, i: _cut(shifted(v, i), k50, p90), x)
        record["us"]["sorted cut alone"] = loop_us(lambda v, i: sorted_cut(shifted(v, i), k50, p90), x)
        for name, us in record["us"].items():
            print(f"[{device}] batch {b}: {name} {us:.1f} us", flush=True)
        with open(out / "sampler.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
