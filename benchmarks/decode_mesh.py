"""Sharded decode, one device against meshes of several: ms per step, tok/s and the scaling.

    PYTHONPATH=. python3 benchmarks/decode_mesh.py [--dims nano|super|tiny] [--layout NANO_NVFP4]
        [--meshes "1;expert=2;expert=4,tensor=2;expert=8"] [--batches 1,32] [--prompt 128] [--steps 32]
        [--repeats 3] [--cpu-devices 0] [--out DIR]

Per mesh ("1": one device without a mesh; else axis=size,...): random params at the dims, built
straight onto the mesh (nemoh.random_params(mesh=...): each device draws its own shards), then per
batch: prefill of random prompts, one warm-up decode call (compiles), `repeats` timed decode calls of
`steps` steps: median ms per step, tok/s, scaling against the first mesh, peak memory of device 0.
Check in the same run: each mesh's prefill logits against the first mesh's on the same params and
prompts, as a relative error (only the order of the split sums differs; random full-width weights
are too chaotic for a token comparison, see docs/BENCHMARKS.md).

Dims: nano (benchmarks/nano_dims.json, the real 52-layer pattern); super (benchmarks/super_dims.json:
Nemotron-3 Super 120B-A12B's widths as publicly reported, 512 experts top-22, latent 1024; its layer
order is not published here, so SUPER_PATTERN has the reported counts, 40 Mamba, 40 MoE and 8
attention layers, in a regular order); tiny (a 4-layer model to try the script on CPU devices).
Results: decode_mesh.jsonl (one object per leg, appended as it completes) and decode_mesh.md in --out.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", choices=("nano", "super", "tiny"), default="nano")
    p.add_argument("--layout", default="NANO_NVFP4")
    p.add_argument("--meshes", default="1;expert=2;expert=4,tensor=2;expert=8")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-devices", type=int, default=0, help="run on this many host CPU devices")
    p.add_argument("--out", default=".")
    return p.parse_args(argv)


ARGS = parse(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_devices:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}"

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nemoh  # noqa: E402
from benchmarks.common import nano_config, peak_memory_bytes, wall_s  # noqa: E402
from nemoh.engine.decode import decode  # noqa: E402
from nemoh.engine.prefill import prefill  # noqa: E402

SUPER_DIMS = Path(__file__).parent / "super_dims.json"
SUPER_PATTERN = "MEMEM*EMEME" * 8  # 40 M, 40 E, 8 *: the reported counts, not the published order
TINY = dict(vocab_size=256, hidden_size=128, hybrid_override_pattern="M*E-", mamba_num_heads=8, mamba_head_dim=16,
            ssm_state_size=16, n_groups=8, conv_kernel=4, chunk_size=8, num_attention_heads=8, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            moe_shared_expert_intermediate_size=128, moe_latent_size=64, eos_token_id=2)


def config(dims: str) -> nemoh.NemotronHConfig:
    if dims == "nano":
        return nano_config()
    if dims == "super":
        return nano_config(SUPER_PATTERN, SUPER_DIMS)
    return nemoh.NemotronHConfig.from_dict(TINY)


def make_mesh(spec: str):
    """"1" -> None (one device, no mesh); "expert=4,tensor=2" -> a mesh of the first 8 devices."""
    if spec == "1":
        return None
    axes = [part.split("=") for part in spec.split(",")]
    shape = tuple(int(size) for _, size in axes)
    return jax.make_mesh(shape, tuple(name for name, _ in axes), devices=jax.devices()[: int(np.prod(shape))])


def main(args) -> None:
    cfg = config(args.dims)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    prompts = {b: [rng.integers(3, cfg.vocab_size, args.prompt).tolist() for _ in range(b)]
               for b in (int(x) for x in args.batches.split(","))}
    rows, first_logits = [], {}
    for spec in args.meshes.split(";"):
        mesh = make_mesh(spec)
        t0 = time.perf_counter()
        params = nemoh.random_params(cfg, args.layout, dtype=jnp.bfloat16, seed=0, mesh=mesh)
        jax.block_until_ready(params)
        build_s = time.perf_counter() - t0
        for batch, ps in prompts.items():
            carry = prefill(params, ps, max_new_tokens=args.steps * (args.repeats + 1) + 1)
            logits = np.asarray(jax.device_get(carry.logits), np.float32)[:batch]
            ref = first_logits.setdefault(batch, logits)
            rel_err = float(np.max(np.abs(logits - ref)) / np.max(np.abs(ref)))
            t1 = time.perf_counter()
            carry = jax.block_until_ready(decode(params, carry, args.steps))
            compile_s = time.perf_counter() - t1

            def timed():
                nonlocal carry
                carry = jax.block_until_ready(decode(params, carry, args.steps))

            ms = 1e3 * statistics.median(wall_s(timed, args.repeats)) / args.steps
            row = dict(dims=args.dims, layout=args.layout, mesh=spec, devices=1 if mesh is None else mesh.size,
                       batch=batch, ms_per_step=round(ms, 3), tok_s=round(batch * 1e3 / ms, 1),
                       prefill_logits_rel_err_vs_first=rel_err, decode_compile_s=round(compile_s, 1),
                       build_s=round(build_s, 1), peak_bytes_device0=peak_memory_bytes(),
                       backend=jax.default_backend(), device=str(jax.devices()[0].device_kind))
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out_dir / "decode_mesh.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        del params, carry
    base = {r["batch"]: r["tok_s"] for r in rows if r["mesh"] == rows[0]["mesh"]}
    lines = ["| mesh | devices | batch | ms / step | tok/s | scaling | logits rel err vs first | decode compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['devices']} | {r['batch']} | {r['ms_per_step']} | {r['tok_s']:,} | "
                     f"{r['tok_s'] / base[r['batch']]:.2f}x | {r['prefill_logits_rel_err_vs_first']:.1e} | "
                     f"{r['decode_compile_s']} |")
    (out_dir / "decode_mesh.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(ARGS)
