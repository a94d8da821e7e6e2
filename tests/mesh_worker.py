"""Sharded runs on 8 CPU devices, in their own process: XLA_FLAGS must give jax 8 host devices before it
starts, and the rest of the suite runs on one. tests/test_mesh.py starts this once and checks the JSON
report it writes (python tests/mesh_worker.py OUT_DIR).

A tiny checkpoint with every layer kind, grouped routing and latent MoE is written in bf16 (random
weights, nemoh.save_hf) and quantised to FP8 and NVFP4; each is loaded in fp32 on one device and over
every mesh, and greedy tokens, logits, leaf shardings, expert reads and named errors are recorded.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # imported (by test_mesh, for its constants) it leaves the importer's jax alone
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import collections  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nemoh  # noqa: E402
from compile_events import compiles  # noqa: E402
from nemoh.engine.decode import decode  # noqa: E402
from nemoh.engine.prefill import prefill  # noqa: E402
from nemoh.io.quantize import quantize_checkpoint  # noqa: E402
from nemoh.io.tensor_source import TensorSource  # noqa: E402
from nemoh.sharding import DEFAULT_RULES, Placement  # noqa: E402
from nemoh.sharding.local import per_device  # noqa: E402
from nemoh.sharding.placement import tracing  # noqa: E402
from pallas_kernels._backend import compiler_partitioned  # noqa: E402

# Every layer kind; Mamba 8 heads in 8 groups; GQA 8 query / 2 kv heads; 8 experts, grouped routing
# (2 groups, keep 1), latent MoE; widths that split 8 ways also as NVFP4 block scales (in/16).
CONFIG = dict(vocab_size=256, hidden_size=128, hybrid_override_pattern="M*E-", mamba_num_heads=8, mamba_head_dim=16,
              ssm_state_size=16, n_groups=8, conv_kernel=4, chunk_size=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=16, intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=128, moe_shared_expert_intermediate_size=128, moe_latent_size=64, n_group=2,
              topk_group=1, routed_scaling_factor=2.0, eos_token_id=2, tie_word_embeddings=False)
MESHES = {"expert4_tensor2": ((4, 2), ("expert", "tensor")), "tensor8": ((8,), ("tensor",)),
          "data2_expert4": ((2, 4), ("data", "expert")), "one_device": ((1,), ("tensor",))}
FORMATS = ("bf16", "FP8", "NVFP4")
NEW = 12


def mesh(name: str):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 256, size=n).tolist() for n in (21, 2, 9)]  # > chunk, < conv kernel, between


def checkpoints(root: Path) -> dict[str, Path]:
    cfg = nemoh.NemotronHConfig.from_dict(CONFIG)
    dirs = {"bf16": nemoh.save_hf(nemoh.random_params(cfg, dtype=jnp.bfloat16, seed=11), root / "bf16")}
    for algo in ("FP8", "NVFP4"):
        quantize_checkpoint(dirs["bf16"], root / algo, algo)
        dirs[algo] = root / algo
    return dirs


def specs(tree) -> list:
    return [str(a.sharding.spec) for a in jax.tree.leaves(tree)]


def shard_shapes(tree) -> list:
    return [list(a.addressable_shards[0].data.shape) for a in jax.tree.leaves(tree)]


def counted_reads(fn):
    """fn() with TensorSource.get counted per tensor name -> (result, {name: reads})."""
    counts, get = collections.Counter(), TensorSource.get

    def counting(self, name, *args, **kwargs):
        counts[name] += 1
        return get(self, name, *args, **kwargs)

    TensorSource.get = counting
    try:
        return fn(), dict(counts)
    finally:
        TensorSource.get = get


def error_of(fn) -> dict:
    """{type, message, new live arrays}: what fn() raised and whether it made any device array first."""
    before = len(jax.live_arrays())
    try:
        fn()
    except Exception as e:  # recorded and checked by the test
        return {"type": type(e).__name__, "message": str(e), "new_arrays": len(jax.live_arrays()) - before}
    return {"type": None, "message": "", "new_arrays": len(jax.live_arrays()) - before}


def run_format(fmt: str, path: Path, report: dict) -> None:
    ps = prompts()
    one = nemoh.load(path, jnp.float32)
    ref = nemoh.generate(one, ps, max_new_tokens=NEW, ignore_eos=True)
    out = report.setdefault("formats", {}).setdefault(fmt, {"reference": ref, "meshes": {}})
    for name in MESHES:
        t0 = time.perf_counter()
        params, reads = counted_reads(lambda: nemoh.load(path, jnp.float32, mesh=mesh(name)))
        with compiles() as first:
            tokens = nemoh.generate(params, ps, max_new_tokens=NEW, ignore_eos=True)
        with compiles() as again:  # the same buckets: nothing new to compile
            carry = prefill(params, ps, max_new_tokens=4)
            after = decode(params, carry, 2)
        out["meshes"][name] = {
            "tokens": tokens,
            "expert_reads": {n: c for n, c in reads.items() if ".experts." in n},
            "max_reads": max(reads.values()),
            "param_specs": specs(params), "param_shard_shapes": shard_shapes(params),
            "carry_specs": specs(after), "carry_shard_shapes": shard_shapes(after),
            "prefill_carry_specs": specs(carry),
            "compiled_first": first, "compiled_again": again,
            "decode_compiled_on": [t for n, t in zip(first, first.threads) if n == "jit(_decode)"],
            "seconds": time.perf_counter() - t0,
        }
        if fmt == "NVFP4" and name == "expert4_tensor2":  # the full-sequence forward too (two more programs)
            want, got = (np.asarray(nemoh.forward(p, [ps[0]])) for p in (one, params))
            out["meshes"][name]["logits_rel_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if fmt == "NVFP4":  # the named leaves the test looks at
            moe, mamba = params.layers[2], params.layers[0]
            out["meshes"][name]["named"] = {
                "experts_up.packed": str(moe.experts_up.packed.sharding.spec),
                "experts_down.scale": str(moe.experts_down.scale.sharding.spec),
                "experts_down.scale.shard": list(moe.experts_down.scale.addressable_shards[0].data.shape),
                "in_proj.scale": str(mamba.in_proj.scale.sharding.spec),
                "out_proj.packed": str(mamba.out_proj.packed.sharding.spec),
                "ssm": str(after.states[0].ssm.sharding.spec),
                "conv": str(after.states[0].conv.sharding.spec),
                "kv_pages": str(after.states[1].k.sharding.spec),
                "tokens": str(after.tokens.sharding.spec),
                "logits": str(after.logits.sharding.spec),
                "embed": str(params.embed.sharding.spec),
            }


def run_errors(root: Path, report: dict) -> None:
    """Meshes that do not fit: named MeshError before any device work."""
    cfg = dict(CONFIG, moe_intermediate_size=64)  # NVFP4 experts_down scale [8, 64/16 = 4, 64]: 4 blocks over 8
    bad = nemoh.NemotronHConfig.from_dict(cfg)
    nemoh.save_hf(nemoh.random_params(bad, dtype=jnp.bfloat16, seed=1), root / "bad_bf16")
    quantize_checkpoint(root / "bad_bf16", root / "bad_nvfp4", "NVFP4")
    t8 = mesh("tensor8")
    errors = report.setdefault("errors", {})
    errors["load"], reads = counted_reads(lambda: error_of(lambda: nemoh.load(root / "bad_nvfp4", mesh=t8)))
    errors["load"]["reads"] = sum(reads.values())
    errors["random_params"] = error_of(lambda: nemoh.random_params(bad, "NVFP4", mesh=t8))
    single = nemoh.load(root / "bad_nvfp4", jnp.float32)
    errors["generate"] = error_of(lambda: nemoh.generate(single, [[1, 2, 3]], max_new_tokens=2, mesh=t8))
    data = nemoh.load(root / "bad_bf16", jnp.float32, mesh=mesh("data2_expert4"))
    errors["num_pages"] = error_of(lambda: nemoh.generate(data, [[1, 2, 3]], max_new_tokens=2,
                                                          cache=nemoh.CacheSpec(page_size=4, num_pages=7)))
    errors["hidden_split"] = error_of(lambda: nemoh.load(root / "bad_bf16", mesh=t8,
                                                         rules=DEFAULT_RULES.with_mesh_axes(hidden="tensor")))
    errors["not_a_mesh"] = error_of(lambda: nemoh.load(root / "bad_bf16", mesh=[["cpu"]]))
    two_groups = nemoh.NemotronHConfig.from_dict(dict(CONFIG, n_groups=2))
    errors["mamba_groups"] = error_of(lambda: nemoh.random_params(two_groups, mesh=t8))


def run_kernel_choice(report: dict) -> None:
    """Where pallas_kernels would run a custom kernel: not in a program XLA partitions, yes per device."""
    placement = Placement(jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("expert", "tensor")))
    seen = {}

    def body(x):
        seen["shard_map body"] = compiler_partitioned()
        return x

    @jax.jit
    def program(x):
        with tracing(placement):
            seen["sharded program"] = compiler_partitioned()
            return per_device(placement, body, jax.sharding.PartitionSpec("expert"),
                              jax.sharding.PartitionSpec("expert"))(x)

    program(jnp.zeros(8))
    seen["outside"] = compiler_partitioned()
    report["kernel_choice"] = seen


def main(out_dir: str) -> None:
    root = Path(out_dir)
    report = {"devices": len(jax.devices())}
    for fmt, path in checkpoints(root).items():
        run_format(fmt, path, report)
    run_errors(root, report)
    run_kernel_choice(report)
    (root / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
