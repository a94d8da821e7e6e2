"""The numpy reference dequantiser: a ModelOpt checkpoint -> the dense Hugging Face checkpoint nemoh runs.

Written apart from the jnp `pallas_kernels.dequantize` (it is that function's oracle), from the
ModelOpt formulas only:
    NVFP4  W[o, k] = e2m1(code[o, k]) * float(weight_scale[o, k // 16]) * weight_scale_2
    FP8    W = float(weight) * weight_scale
A module is dequantised when it has a ".weight_scale"; its format is told by the ".weight" dtype (U8 NVFP4,
F8_E4M3 FP8). Output: the original dense key set (no scale tensors), config.json without
quantization_config, no hf_quant_config.json, every other file copied. Tests and the token gate run
transformers on it, i.e. on exactly the weights nemoh runs.
CLI: python -m nemoh.io.dequantize QUANT_DIR DST [--dtype float32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ml_dtypes
import numpy as np

from nemoh.errors import CheckpointError
from nemoh.io.quantize import (DEFAULT_SHARD_BYTES, E2M1_VALUES, ShardWriter, new_output_dir, read_config,
                               write_side_files)
from nemoh.io.tensor_source import TensorSource
from pallas_kernels.formats import NVFP4_BLOCK

OUTPUT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] -> uint8 codes [..., n]: code 2k is the low nibble of byte k, 2k+1 the high one."""
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes


def nvfp4_dequantize(packed: np.ndarray, block_scale: np.ndarray, global_scale: np.ndarray) -> np.ndarray:
    """packed u8 [..., out, in/2], block_scale fp8 [..., out, in/16], global_scale f32 [...] -> f32 [..., out, in].

    Rounded as the formula reads: (e2m1 * block scale), exact in float32, then * global scale.
    """
    values = E2M1_VALUES[unpack_nibbles(packed)]
    *lead, out_dim, in_dim = values.shape
    blocks = values.reshape(*lead, out_dim, in_dim // NVFP4_BLOCK, NVFP4_BLOCK)
    scaled = blocks * block_scale.astype(np.float32)[..., None]
    glob = np.asarray(global_scale, np.float32)[..., None, None, None]
    return (scaled * glob).reshape(values.shape)


def fp8_dequantize(data: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """data fp8 [..., out, in], scale f32 [...] -> f32 [..., out, in]."""
    return data.astype(np.float32) * np.asarray(scale, np.float32)[..., None, None]


def dequantize_module(src: TensorSource, module: str) -> np.ndarray:
    """One quantised linear's tensors (checked for shape and dtype) -> its dense float32 weight."""
    name = module + ".weight"
    stored = src.dtype_of(name)
    if stored == "F8_E4M3":
        data = src.get(name)
        return fp8_dequantize(data, src.get(module + ".weight_scale", shape=(), dtypes=("F32",)))
    if stored == "U8":
        packed = src.get(name)
        if packed.ndim != 2:
            raise CheckpointError(f"tensor {name} in {src.file_of(name)}: NVFP4 weight must be 2-D, "
                                  f"got shape {list(packed.shape)}")
        out_dim, half = packed.shape
        if (2 * half) % NVFP4_BLOCK:
            raise CheckpointError(f"tensor {name} in {src.file_of(name)}: {2 * half} inputs are not a whole "
                                  f"number of {NVFP4_BLOCK}-blocks")
        block = src.get(module + ".weight_scale", shape=(out_dim, 2 * half // NVFP4_BLOCK), dtypes=("F8_E4M3",))
        glob = src.get(module + ".weight_scale_2", shape=(), dtypes=("F32",))
        return nvfp4_dequantize(packed, block, glob)
    raise CheckpointError(f"tensor {name} in {src.file_of(name)}: has a weight_scale but dtype {stored} "
                          f"is neither NVFP4 (U8) nor FP8 (F8_E4M3)")


def dequantize_checkpoint(quant_dir: str | Path, dst_dir: str | Path, dtype: str = "float32",
                          max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write the dense checkpoint of the quantised one in `quant_dir` to the new `dst_dir`.

    Dequantised linears are cast to `dtype` ("float32", "bfloat16" or "float16"; float32 is exact);
    all other tensors are copied unchanged. Returns the dequantised module names.
    """
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {list(OUTPUT_DTYPES)}")
    quant_dir, dst_dir = Path(quant_dir), Path(dst_dir)
    config = {k: v for k, v in read_config(quant_dir).items() if k != "quantization_config"}
    src = TensorSource(quant_dir)
    new_output_dir(dst_dir)
    writer = ShardWriter(dst_dir, max_shard_bytes)
    done = []
    for name in sorted(src.names()):
        module = name.removesuffix(".weight")
        if name.endswith(SCALE_SUFFIXES):
            continue
        if name.endswith(".weight") and src.has(module + ".weight_scale"):
            writer.add(name, dequantize_module(src, module).astype(OUTPUT_DTYPES[dtype]))
            done.append(module)
        else:
            writer.add(name, src.get(name))
    writer.finish()
    write_side_files(quant_dir, dst_dir, config, {})
    return done


def main(argv: list[str] | None = None) -> None:
    """CLI entry: python -m nemoh.io.dequantize QUANT_DIR DST [--dtype float32]."""
    parser = argparse.ArgumentParser(prog="python -m nemoh.io.dequantize", description=__doc__.split("\n")[0])
    parser.add_argument("src", help="ModelOpt-quantised checkpoint directory")
    parser.add_argument("dst", help="new (empty) output directory")
    parser.add_argument("--dtype", default="float32", choices=sorted(OUTPUT_DTYPES))
    args = parser.parse_args(argv)
    done = dequantize_checkpoint(args.src, args.dst, args.dtype)
    print(f"{args.dst}: {len(done)} linear modules dequantised to {args.dtype}")


if __name__ == "__main__":
    main()
