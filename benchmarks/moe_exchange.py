"""How a sharded MoE layer's routed experts exchange tokens and outputs: the three ways, timed on one host.

    PYTHONPATH=. python3 benchmarks/moe_exchange.py [--cpu-devices 8] [--tokens 8,64,512] [--hidden 2048]
        [--width 1024] [--experts 64] [--top-k 6] [--repeats 20] [--out DIR]

Experts split over the mesh axis "expert" (all devices), tokens whole on every device between layers
(as every sharded layer leaves them). Each way gives the same [T, H] on every device:
  psum        (nemoh's: nemoh.layers.moe.moe_sharded) every device runs its own experts on the pairs
              routed to them, one psum of the [T, H] parts (fp32).
  all_gather  the same parts, all-gathered [n, T, H] and summed on every device in one fixed order.
  all_to_all  every device takes T/n of the tokens, routes them, sends each (token, expert) pair to the
              device holding the expert (capacity T/n * k a device, nothing dropped), which runs it and
              sends it back; the weighted sums are all-gathered to [T, H].
The bare_psum and bare_all_gather rows time the two collectives alone on a [T, H] part per device.
Per way and token count: median wall ms of `repeats` calls after a warm-up, the collectives of the
compiled program and the bytes each device sends in them (their sizes read off the HLO, which is the
same program on GPUs, under the usual ring model), and the largest difference from psum's output. On CPU (--cpu-devices) the "collectives" are memory
copies between threads, and the "xla" reference computes every pair it is handed, so the times say
what each way costs in dispatch and copies, not what NVLink would do.
Results: moe_exchange.jsonl and moe_exchange.md in --out.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-devices", type=int, default=0, help="run on this many host CPU devices")
    p.add_argument("--tokens", default="8,64,512")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=".")
    return p.parse_args(argv)


ARGS = parse(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_devices:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}"

import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import nemoh  # noqa: E402
from benchmarks.common import wall_s  # noqa: E402
from nemoh.layers.moe import _routed, moe_sharded, own_experts, route  # noqa: E402
from nemoh.sharding.params import shard_params  # noqa: E402
from nemoh.sharding.placement import make_placement, tracing  # noqa: E402
from pallas_kernels import moe_experts  # noqa: E402

AXIS = "expert"
_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                         r"(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def collectives(hlo: str, n: int) -> tuple[dict[str, int], int]:
    """(count by kind, bytes a device sends) of a compiled program's collectives, by the usual ring
    model: all-reduce 2(n-1)/n of its size, all-gather and all-to-all (n-1)/n of their result."""
    counts, sent = {}, 0.0
    share = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
             "reduce-scatter": n - 1, "collective-permute": 1.0}
    for result, kind in _COLLECTIVE.findall(hlo):
        counts[kind] = counts.get(kind, 0) + 1
        size = sum(_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                   for t, dims in _ARRAY.findall(result))
        sent += share[kind] * size
    return counts, int(sent)


def way_psum(p, x, cfg, placement):
    return moe_sharded(p, x, cfg, None, placement)


def way_all_gather(p, x, cfg, placement):
    def local(p, x):
        count = p.experts_up.shape[0]
        part = _routed(p, x, cfg, None, own_experts(jax.lax.axis_index(AXIS) * count, count)).astype(jnp.float32)
        return jnp.sum(jax.lax.all_gather(part, AXIS), axis=0).astype(x.dtype)

    return _unchecked(placement, local, p, x)


def way_all_to_all(p, x, cfg, placement):
    n, k = placement.ways("experts"), cfg.num_experts_per_tok

    def local(p, x):
        count = p.experts_up.shape[0]
        rows = x.shape[0] // n
        mine = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(AXIS) * rows, rows)
        idx, w = route(mine, p.router, p.router_bias, cfg)
        dest = (idx // count).reshape(-1)  # [rows * k]: the device holding each pair's expert
        order = jnp.argsort(dest, stable=True)
        sizes = jnp.zeros((n,), jnp.int32).at[dest].add(1)
        capacity = rows * k
        slot = dest[order] * capacity + jnp.arange(rows * k) - (jnp.cumsum(sizes) - sizes)[dest[order]]
        send = jnp.zeros((n * capacity, x.shape[1]), x.dtype).at[slot].set(mine[order // k])
        expert = jnp.full((n * capacity,), -1, jnp.int32).at[slot].set((idx.reshape(-1) % count)[order])
        swap = lambda a: jax.lax.all_to_all(a.reshape(n, capacity, *a.shape[1:]), AXIS, 0, 0).reshape(a.shape)
        got, got_expert = swap(send), swap(expert)
        out = moe_experts(got, jnp.maximum(got_expert, 0)[:, None], jnp.ones((n * capacity, 1), jnp.float32),
                          p.experts_up, p.experts_down, valid=got_expert >= 0)
        pairs = jnp.zeros((rows * k, x.shape[1]), jnp.float32).at[order].set(swap(out)[slot].astype(jnp.float32))
        y = jnp.einsum("tk,tkh->th", w, pairs.reshape(rows, k, -1), precision=jax.lax.Precision.HIGHEST)
        return jax.lax.all_gather(y.astype(x.dtype), AXIS, tiled=True)

    return _unchecked(placement, local, p, x)


def _unchecked(placement, local, p, x):
    """local(p, x) -> [T, H] per device, replicated: an all-gather's result is the same on every device,
    which shard_map's replication check cannot tell (so it is off)."""
    return jax.shard_map(local, mesh=placement.mesh, in_specs=(placement.specs(p), P()), out_specs=P(),
                         check_vma=False)(p, x)


def bare(collective):
    """The collective alone on a [T, H] part per device (no experts): what the exchange itself costs."""
    def way(p, x, cfg, placement):
        local = lambda x: collective(x * (1.0 + jax.lax.axis_index(AXIS)))
        return jax.shard_map(local, mesh=placement.mesh, in_specs=P(), out_specs=P(), check_vma=False)(x)

    return way


WAYS = {"psum": way_psum, "all_gather": way_all_gather, "all_to_all": way_all_to_all,
        "bare_psum": bare(lambda x: jax.lax.psum(x, AXIS)),
        "bare_all_gather": bare(lambda x: jnp.sum(jax.lax.all_gather(x, AXIS), axis=0))}


def main(args) -> None:
    n = len(jax.devices())
    cfg = nemoh.NemotronHConfig.from_dict(dict(
        vocab_size=256, hidden_size=args.hidden, hybrid_override_pattern="E", n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.width, moe_shared_expert_intermediate_size=0,
        n_shared_experts=0, routed_scaling_factor=2.5, eos_token_id=2))
    mesh = jax.make_mesh((n,), (AXIS,))
    p = shard_params(nemoh.random_params(cfg, dtype=jnp.float32, seed=0), mesh).layers[0]
    placement = make_placement(mesh, None)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = jax.device_put(jax.random.normal(jax.random.key(1), (tokens, args.hidden), jnp.float32),
                           jax.sharding.NamedSharding(placement.mesh, P()))
        outputs = {}
        for name, way in WAYS.items():
            def call(p, x, way=way):
                with tracing(placement):
                    return way(p, x, cfg, placement)

            fn = jax.jit(call)
            counts, sent = collectives(fn.lower(p, x).compile().as_text(), n)
            outputs[name] = np.asarray(jax.block_until_ready(fn(p, x)))
            ms = 1e3 * statistics.median(wall_s(lambda: jax.block_until_ready(fn(p, x)), args.repeats))
            row = dict(way=name, tokens=tokens, devices=n, ms=round(ms, 3), collectives=counts, bytes_per_device=sent,
                       max_abs_diff_vs_psum=None if name.startswith("bare") else
                       float(np.max(np.abs(outputs[name] - outputs["psum"]))),
                       backend=jax.default_backend(), hidden=args.hidden, width=args.width, experts=args.experts,
                       top_k=args.top_k)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out_dir / "moe_exchange.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    lines = ["| tokens | way | ms | collectives | bytes a device | max diff vs psum |", "|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{v} {k}" for k, v in r["collectives"].items())
        lines.append(f"| {r['tokens']} | {r['way']} | {r['ms']} | {kinds} | {r['bytes_per_device']:,} | "
                     f"{'-' if r['max_abs_diff_vs_psum'] is None else format(r['max_abs_diff_vs_psum'], '.1e')} |")
    (out_dir / "moe_exchange.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(ARGS)
