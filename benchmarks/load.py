"""Cold start: write a Nano-size quantised checkpoint once, then time fresh processes from `nemoh.load`
to the first generated token, with a cold and then a warm persistent compilation cache; then the same
from a nemoh.save (orbax) copy of the params, against the safetensors load.

    PYTHONPATH=. python3 benchmarks/load.py --dir /tmp/nano-nvfp4 [--layout NANO_NVFP4] [--out DIR]

The checkpoint is written directly in the ModelOpt layout (safetensors shards of <= 4 GB with an index,
config.json with quantization_config, hf_quant_config.json, an input_scale on every quantised linear):
every tensor the loader asks for (nemoh.io.layout) drawn by nemoh.random_params' reader on the default
device and converted back to the stored form (`to_hf`). Each timed process imports nemoh, loads the
checkpoint onto the device and generates one token from a 16-token prompt; it reports import, load
and first-token seconds. The orbax leg saves the loaded params once (nemoh.save) and times a fresh
process restoring them (warm cache). Results: printed, and load.json in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from benchmarks.common import NANO_DIMS, NANO_PATTERN
from nemoh.config import NemotronHConfig
from nemoh.io.layout import hf_layout
from nemoh.io.modelopt import CONFIG, HF_QUANT_CONFIG
from nemoh.io.quantize import ShardWriter, plan_modules, quant_configs, stored_algos
from nemoh.random_params import _RandomReader
from pallas_kernels import is_quantized

FIRST_TOKEN = """
import json, sys, time
t0 = time.perf_counter()
import jax, nemoh
t1 = time.perf_counter()
params = nemoh.load(sys.argv[1])
jax.block_until_ready(params)
t2 = time.perf_counter()
nemoh.generate(params, [list(range(1, 17))], max_new_tokens=1)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2, "total_s": t3 - t0,
                  "device": jax.devices()[0].device_kind}))
"""


SAVE = "import sys, nemoh; nemoh.save(nemoh.load(sys.argv[1]), sys.argv[2])"


def write_checkpoint(config: dict, layout: str, out: Path, seed: int = 0) -> float:
    """Write the checkpoint of `config` in `layout` to the new directory `out`; returns its bytes."""
    cfg = NemotronHConfig.from_dict(config)
    specs = hf_layout(cfg)
    modules = [s.name for s in specs if s.projection]
    plan = plan_modules(layout, modules, cfg.layer_kinds)
    reader = _RandomReader(cfg, "dense" if layout == "dense" else layout, jnp.bfloat16, seed)
    out.mkdir(parents=True, exist_ok=False)
    writer = ShardWriter(out)
    for s in specs:
        if not s.projection:
            writer.add(s.name, np.asarray(reader.vector(s.name, s.shape, s.dtype)))
            continue
        weight = reader.linear(s.name, *s.shape)
        if not is_quantized(weight):
            writer.add(s.name + ".weight", np.asarray(weight))
            continue
        for suffix, tensor in weight.to_hf().items():
            writer.add(f"{s.name}.{suffix}", np.asarray(tensor))
        writer.add(s.name + ".input_scale", np.asarray(1.0, np.float32))
    writer.finish()
    hf_quant, quantization_config = quant_configs(cfg, stored_algos(plan, calibrated=True))
    (out / CONFIG).write_text(json.dumps({**config, "quantization_config": quantization_config}, indent=2))
    (out / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2))
    return sum(f.stat().st_size for f in out.iterdir())


def time_fresh_process(model_dir: Path, cache_dir: Path) -> dict:
    env = {**os.environ, "NEMOH_COMPILATION_CACHE": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", FIRST_TOKEN, str(model_dir)], env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"timed process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="checkpoint directory (written first if it has no config.json)")
    ap.add_argument("--layout", default="NANO_NVFP4")
    ap.add_argument("--dims", default=str(NANO_DIMS))
    ap.add_argument("--pattern", default=NANO_PATTERN)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    model_dir = Path(args.dir)
    result: dict = {"layout": args.layout}
    if not (model_dir / CONFIG).exists():
        config = {**json.loads(Path(args.dims).read_text()), "hybrid_override_pattern": args.pattern}
        t0 = time.perf_counter()
        size = write_checkpoint(config, args.layout, model_dir)
        result.update(write_s=time.perf_counter() - t0, checkpoint_gb=size / 1e9)
        print(f"wrote {model_dir}: {size / 1e9:.1f} GB in {result['write_s']:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="nemoh-cc-") as cache, \
            tempfile.TemporaryDirectory(prefix="nemoh-saved-") as saved:
        for run, source in (("cold_cache", model_dir), ("warm_cache", model_dir), ("orbax_warm_cache", f"{saved}/params")):
            if run == "orbax_warm_cache":  # saved after the safetensors legs, which are timed first
                subprocess.run([sys.executable, "-c", SAVE, str(model_dir), source], check=True)
            result[run] = time_fresh_process(Path(source), Path(cache))
            r = result[run]
            print(f"{run}: import {r['import_s']:.1f} s, load {r['load_s']:.1f} s, first token "
                  f"{r['first_token_s']:.1f} s, total {r['total_s']:.1f} s ({r['device']})", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "load.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
