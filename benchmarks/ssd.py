"""The chunked SSD scan alone at Nano widths: this tree's against another tree's, in one process.

    PYTHONPATH=. python3 benchmarks/ssd.py [--shapes 1x2048,8x512] [--against _old] [--rounds 20]
        [--dims JSON] [--out DIR]

Per shape (rows x tokens, from a random initial state): each variant's relative error against the
per-token recurrence (nemoh.layers.ssd.ssd_reference, fp32), then `rounds` rounds of one timed call of
each variant, in alternating order: the median wall µs of a call (device work and whatever the program
waits on the host for, e.g. a loop's predicate on each trip) and, where CUPTI works, the device µs and
the number of kernels of one call. --against DIR loads DIR/nemoh/layers/ssd.py (a tree extracted with
`git archive REV nemoh | tar -x -C DIR`) as the second variant. Results: ssd.jsonl in --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import NANO_DIMS, nano_config, wall_s
from benchmarks.kernels import cupti_timings, max_rel
from benchmarks.prefill import parse_shapes
from nemoh.layers import ssd


def load_ssd(tree: str):
    """nemoh/layers/ssd.py of another tree, as a module of its own."""
    path = Path(tree) / "nemoh" / "layers" / "ssd.py"
    spec = importlib.util.spec_from_file_location(f"ssd_of_{Path(tree).name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(cfg, rows: int, tokens: int, key):
    """Random scan inputs of the shapes and ranges a Mamba layer gives: dt in (0, 1), A < 0."""
    nh, hd, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    k = jax.random.split(key, 7)
    return (jax.random.normal(k[0], (rows, tokens, nh, hd)),
            jax.nn.softplus(jax.random.normal(k[1], (rows, tokens, nh)) - 2.0),
            -jnp.exp(jax.random.normal(k[2], (nh,))),
            jax.random.normal(k[3], (rows, tokens, G, N)),
            jax.random.normal(k[4], (rows, tokens, G, N)),
            jax.random.normal(k[5], (nh,)),
            0.1 * jax.random.normal(k[6], (rows, nh, hd, N)))


def compare(variants: dict, cfg, rows: int, tokens: int, rounds: int) -> list[dict]:
    args = inputs(cfg, rows, tokens, jax.random.PRNGKey(rows * 100003 + tokens))
    y_ref, s_ref = jax.jit(ssd.ssd_reference)(*args)
    programs = {name: jax.jit(lambda *a, m=m: m.ssd_chunked(*a[:6], cfg.chunk_size, a[6]))
                for name, m in variants.items()}
    out = {}
    for name, fn in programs.items():
        y, s = jax.block_until_ready(fn(*args))
        out[name] = {"variant": name, "rows": rows, "tokens": tokens, "err_y": max_rel(y, y_ref),
                     "err_state": max_rel(s, s_ref), "wall_us": []}
    order = list(programs)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            (seconds,) = wall_s(lambda: jax.block_until_ready(programs[name](*args)), 1)
            out[name]["wall_us"].append(1e6 * seconds)
    for name, fn in programs.items():
        timings = cupti_timings(fn, args, quiet=True)
        out[name]["device_us"] = None if timings is None else 1e3 * sum(ms for _, ms in timings)
        out[name]["kernels"] = None if timings is None else len(timings)
        out[name]["median_wall_us"] = statistics.median(out[name].pop("wall_us"))
    return list(out.values())


def line(r: dict) -> str:
    dev = "" if r["device_us"] is None else f", device {r['device_us']:.1f} µs in {r['kernels']} kernels"
    return (f"{r['variant']} {r['rows']}x{r['tokens']}: {r['median_wall_us']:.1f} µs a call{dev}; "
            f"error y {r['err_y']:.1e}, state {r['err_state']:.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x2048,8x512", help="rows x tokens, comma separated")
    ap.add_argument("--against", default="", help="a tree whose nemoh/layers/ssd.py is the second variant")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dims", default=str(NANO_DIMS), help="config.json fields giving the widths (default: Nano's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cfg = nano_config(dims=Path(args.dims))
    variants = {"this tree": ssd}
    if args.against:
        variants[args.against] = load_ssd(args.against)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"device {jax.devices()[0].device_kind} | heads {cfg.mamba_num_heads} x {cfg.mamba_head_dim}, "
          f"{cfg.n_groups} groups, state {cfg.ssm_state_size}, chunk {cfg.chunk_size}", flush=True)
    for rows, tokens in parse_shapes(args.shapes):
        for r in compare(variants, cfg, rows, tokens, args.rounds):
            print(line(r), flush=True)
            with (out / "ssd.jsonl").open("a") as f:
                f.write(json.dumps({**r, "device": jax.devices()[0].device_kind}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
