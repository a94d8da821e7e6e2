"""TensorSource: tensor-by-tensor access to a checkpoint directory's safetensors files.

Reads one model.safetensors or the shards named in model.safetensors.index.json. Only JSON headers
and raw little-endian tensor bytes are parsed (the safetensors format): nothing from the checkpoint
is executed. Each tensor is read on demand through a memory map, so peak host memory stays near the
size of what the caller keeps.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from nemoh.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class _File:
    """One safetensors file: its parsed header and a lazily opened memory map."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise ValueError("file shorter than its 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER:
                    raise ValueError(f"header length {n} is implausible")
                header = json.loads(f.read(n))
            self.data_start = 8 + n
            self.size = path.stat().st_size
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        self._map: np.memmap | None = None

    def read(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        where = f"tensor {name} in {self.path.name}"
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            start, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: malformed header entry {entry!r}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * np.dtype(dtype).itemsize or self.data_start + end > self.size:
            raise CheckpointError(f"{where}: byte range [{start}, {end}) does not fit its shape/dtype or the file")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self.data_start + start : self.data_start + end]
        return np.asarray(raw).view(dtype).reshape(shape)


class TensorSource:
    """Maps tensor names to their file; `get` returns a numpy array (ml_dtypes for bf16/fp8)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        elif (self.directory / SINGLE_FILE).exists():
            files, weight_map = [SINGLE_FILE], None
        else:
            raise CheckpointError(f"{self.directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._files: dict[str, _File] = {}
        self._file_of: dict[str, str] = {}
        self.consumed: set[str] = set()  # names read or marked used: the loader reports the rest as unexpected
        for fname in files:
            path = self.directory / fname
            if not path.exists():
                raise CheckpointError(f"shard {fname} listed in {INDEX_FILE} is missing from {self.directory}")
            self._files[fname] = _File(path)
            for n in self._files[fname].entries:
                self._file_of[n] = fname
        for n, fname in (weight_map or {}).items():
            if self._file_of.get(n) != fname:
                raise CheckpointError(f"tensor {n}: {INDEX_FILE} names {fname}, but that file does not hold it")

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> str:
        return self._file_of.get(name, "<absent>")

    def _entry(self, name: str) -> dict:
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.directory}")
        return self._files[self._file_of[name]].entries[name]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype_of(self, name: str) -> str:
        """safetensors dtype string: F32, BF16, F16, F8_E4M3, U8, ..."""
        return self._entry(name)["dtype"]

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtypes: tuple[str, ...] | None = None,
            view: bool = False) -> np.ndarray:
        """Read one tensor; check its shape and safetensors dtype when given (CheckpointError names both).
        An array of its own, or with `view` a read-only view of the memory-mapped file, for a caller that
        copies it at once (a view outlives no rewrite of the file, and jax on a CPU may alias it)."""
        where = f"tensor {name} in {self.file_of(name)}"
        if dtypes is not None and self.dtype_of(name) not in dtypes:
            raise CheckpointError(f"{where}: dtype {self.dtype_of(name)}, expected one of {list(dtypes)}")
        if shape is not None and self.shape_of(name) != tuple(shape):
            raise CheckpointError(f"{where}: shape {list(self.shape_of(name))}, expected {list(shape)}")
        if self.dtype_of(name) not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {self.dtype_of(name)}")
        self.consumed.add(name)
        array = self._files[self._file_of[name]].read(name)
        return array if view else array.copy()

    def mark_used(self, name: str) -> None:
        """Accept a tensor that is present but deliberately not loaded (e.g. an unused input_scale)."""
        self.consumed.add(name)

    def unconsumed(self) -> list[str]:
        return sorted(self.names() - self.consumed)
