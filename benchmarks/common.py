"""What the benchmarks share: the Nano config, timing, the HBM ceiling, byte counts, device memory."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from nemoh.cli.timing import COMPILE_EVENTS
from nemoh.config import ATTENTION, MAMBA, MLP, MOE, NemotronHConfig
from pallas_kernels import is_quantized

NANO_DIMS = Path(__file__).parent / "nano_dims.json"  # Nemotron-3 Nano config.json minus its layer layout
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # its 52 layers


def nano_config(pattern: str = NANO_PATTERN, dims: Path = NANO_DIMS, **overrides) -> NemotronHConfig:
    """Nemotron-3 Nano 30B-A3B's config (widths from `dims`) with the given layer pattern and overrides."""
    dims = json.loads(Path(dims).read_text())
    return NemotronHConfig.from_dict({**dims, "hybrid_override_pattern": pattern, **overrides})


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The options every Nano-dims benchmark takes: --no-gate, --pattern, --dims, --out, --workdir."""
    ap.add_argument("--no-gate", action="store_true", help="skip the token gate (legs are labelled ungated)")
    ap.add_argument("--pattern", default=NANO_PATTERN, help="layer pattern of the timed model (default: Nano's 52)")
    ap.add_argument("--dims", default=str(NANO_DIMS), help="config.json fields giving the widths (default: Nano's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "nemoh-bench"))


def model_setup(args) -> tuple[Path, Path, NemotronHConfig, dict[str, int]]:
    """(output dir, work dir, both created; the config; layers per profile scope, lm_head included)."""
    out_dir, work = Path(args.out), Path(args.workdir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    cfg = nano_config(args.pattern, dims=Path(args.dims))
    counts = {name: cfg.layer_kinds.count(kind)
              for kind, name in ((MAMBA, "mamba"), (ATTENTION, "attention"), (MOE, "moe"), (MLP, "mlp"))}
    return out_dir, work, cfg, {**counts, "lm_head": 1}


@contextlib.contextmanager
def compile_seconds():
    """Yields a Counter: seconds of tracing, lowering and XLA compiling per program name
    ("_prefill", "_decode", ...) inside the block, whichever thread compiled (the decode program
    compiles on a worker thread beside prefill)."""
    seconds = collections.Counter()

    def listen(event: str, duration: float, fun_name: str = "?", **_):
        if event in COMPILE_EVENTS:
            seconds[fun_name.removeprefix("jit(").removesuffix(")")] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def wall_s(fn, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of fn() (which must block until its device work is done)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def warm_up(fn, seconds: float = 1.0, min_calls: int = 2) -> int:
    """Call fn() (blocking) untimed until `seconds` have passed and at least min_calls ran; returns the
    calls. Timing right after the first call measured slower in a fresh process (prefill: 11,710 against
    15,906 tok/s for the same program after other work on the H200)."""
    t0, calls = time.perf_counter(), 0
    while calls < min_calls or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return calls


def parse_tilings(spec: str) -> list:
    """Kernel tilings from "tk=128,ctas_per_sm=8;stages=2" (';' between tilings, Tiling's field names)."""
    from pallas_kernels._blocked import Tiling

    fields = {f.name: f.type for f in dataclasses.fields(Tiling)}
    tilings = []
    for part in filter(None, spec.split(";")):
        kw = {}
        for item in part.split(","):
            name, _, value = item.partition("=")
            if name not in fields or not value:
                raise ValueError(f"bad tiling item {item!r} in {spec!r}; fields: {sorted(fields)}")
            kw[name] = value.lower() in ("1", "true") if "bool" in str(fields[name]) else int(value)
        tilings.append(Tiling(**kw))
    return tilings


def parse_xla_options(spec: str) -> list[dict]:
    """XLA option sets from "key=value key=value;key=value" (';' between sets, spaces between options);
    true/false become booleans and integers ints, anything else stays a string (a comma list included)."""
    sets = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        options = {}
        for item in part.split():
            key, _, value = item.partition("=")
            if not key.startswith("xla_") or not value:
                raise ValueError(f"bad XLA option {item!r} in {spec!r}: want xla_...=VALUE")
            options[key] = _option_value(value)
        sets.append(options)
    return sets


def _option_value(value: str):
    """"true"/"false" -> bool, an integer -> int, anything else as it is."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return int(value) if value.lstrip("-").isdigit() else value


def parse_sampling(spec: str) -> Sampling:
    """"temperature=0.8,top_k=50,top_p=0.9" -> Sampling (any of the three; "" is greedy)."""
    from nemoh.engine.sampling import Sampling

    kinds = {"temperature": float, "top_k": int, "top_p": float}
    kw = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name not in kinds or not value:
            raise ValueError(f"bad sampling item {item!r} in {spec!r}; fields: {sorted(kinds)}")
        kw[name] = kinds[name](value)
    return Sampling(**kw)


def hbm_ceiling_gbs(elements: int = 1 << 30) -> float:
    """Measured HBM bandwidth, GB/s: the faster of reading a 2 GiB bf16 array (a sum) and scaling it in
    place (read + write, the buffer donated), each the median of 10 after a warm-up. A copy into a new
    array alone measured 2.2-2.7 TB/s on the H200, below what weight kernels read at (4.3 TB/s), and
    decode mostly reads."""
    x = jax.random.normal(jax.random.key(0), (elements,), jnp.bfloat16)
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    jax.block_until_ready(read(x))
    read_s = statistics.median(wall_s(lambda: jax.block_until_ready(read(x)), 10))
    scale = jax.jit(lambda a: a * 1.5, donate_argnums=0)
    held = [scale(x)]

    def scale_in_place():
        held[0] = jax.block_until_ready(scale(held[0]))

    scale_in_place()
    both_s = statistics.median(wall_s(scale_in_place, 10))
    return max(x.size * 2 / read_s, 2 * x.size * 2 / both_s) / 1e9


def nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` uniformly routed tokens select (top_k each)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def bytes_per_step(params, batch: int, context: int, distinct_experts: float | None = None) -> dict[str, float]:
    """Bytes one decode step must move at least, by kind: weights (routed experts counted for
    `distinct_experts` a MoE layer, by default the expected distinct experts of `batch` uniformly routed
    tokens), Mamba states (read + write), KV pages read (`context` tokens per sequence) and written."""
    cfg = params.config
    if distinct_experts is None:
        distinct_experts = expected_distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch)
    weights = nbytes((params.norm_f, params.lm_head if params.lm_head is not None else params.embed))
    weights += batch * cfg.hidden_size * params.embed.dtype.itemsize
    states = kv = 0.0
    for kind, layer in zip(cfg.layer_kinds, params.layers):
        if kind == MOE:
            experts = nbytes((layer.experts_up, layer.experts_down))
            weights += nbytes(layer) - experts + distinct_experts / cfg.n_routed_experts * experts
        else:
            weights += nbytes(layer)
        if kind == MAMBA:
            ssm = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * 4
            conv = (cfg.conv_kernel - 1) * cfg.conv_dim * params.embed.dtype.itemsize
            states += 2 * batch * (ssm + conv)
        if kind == ATTENTION:
            kv += 2 * batch * (context + 1) * cfg.num_key_value_heads * cfg.head_dim * params.embed.dtype.itemsize
    return {"weights": weights, "states": states, "kv": kv, "total": weights + states + kv}


def peak_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def describe_layout(params) -> dict[str, int]:
    """Count of projection weights by storage format (dense, FP8Weight, NVFP4Weight)."""
    counts: dict[str, int] = {}
    for leaf in jax.tree.leaves(params.layers, is_leaf=is_quantized):
        name = type(leaf).__name__ if is_quantized(leaf) else "dense"
        if name != "dense" or leaf.ndim >= 2:
            counts[name] = counts.get(name, 0) + 1
    return counts
