"""Argument checks shared by every public entry point.

Each check returns the value normalised (a Python int / float / bool, an integer array, ...) or raises
RequestError naming the argument, the value and what is allowed. Integers are Python or numpy integers,
never bools; reals are integers or floats (never bools or strings), finite and within float32's range.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from nemoh.errors import RequestError

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
LOAD_DTYPES = ("float32", "bfloat16", "float16")


def show(value: Any) -> str:
    """repr(value), cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fail(name: str, value: Any, allowed: str) -> NoReturn:
    raise RequestError(f"{name}={show(value)}: {allowed}")


def is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _bounds(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    return f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else ""


def integer(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """A Python or numpy integer (not a bool) within [lo, hi]."""
    if not is_integer(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        fail(name, value, "must be an integer" + _bounds(lo, hi))
    return int(value)


def real(name: str, value: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    """A finite int or float (not a bool or a string) within float32's range and [lo, hi] ((lo, hi]
    with lo_open)."""
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    try:
        v = float(value) if number else math.nan
    except OverflowError:  # an int beyond float64
        v = math.inf
    below = lo is not None and (v <= lo if lo_open else v < lo)
    if not (math.isfinite(v) and abs(v) <= FLOAT32_MAX) or below or (hi is not None and v > hi):
        span = f" in ({lo}, {hi}]" if lo_open else _bounds(lo, hi)
        fail(name, value, "must be a finite number" + span)
    return v


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        fail(name, value, "must be True or False")
    return bool(value)


def instance(name: str, value: Any, cls: type, what: str) -> Any:
    if not isinstance(value, cls):
        fail(name, value, f"must be {what}, got {type(value).__name__}")
    return value


def optional(check: Callable[..., Any], name: str, value: Any, *args) -> Any:
    """None, or `value` passed by check(name, value, *args)."""
    return None if value is None else check(name, value, *args)


def per_row(name: str, value: Any, n: int | None, check: Callable[[str, Any], Any]) -> list:
    """One value for every row, or a list / tuple / 1-D array of one value per row (n rows; any
    non-zero number when n is None); each value checked by check(name, value)."""
    if isinstance(value, (list, tuple)):
        values = list(value)
    elif isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) > 0:
        values = list(np.asarray(value)) if np.ndim(value) == 1 else []
    else:
        return [check(name, value)] * (n or 1)
    if not values or (n is not None and len(values) != n):
        want = f"a list of {n} values" if n is not None else "a list of one value per prompt"
        fail(name, value, f"must be one value for every prompt, or {want}")
    return [check(f"{name}[{i}]", v) for i, v in enumerate(values)]


def seed(name: str, value: Any) -> int:
    """Any integer (used whole, whatever its size or sign)."""
    if not is_integer(value):
        fail(name, value, "must be an integer (any size), or a list of one per prompt")
    return int(value)


def path(name: str, value: Any) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        fail(name, value, f"must be a path (str or os.PathLike), got {type(value).__name__}")
    return Path(value)


def float_dtype(name: str, value: Any) -> np.dtype:
    """A floating dtype nemoh computes in: float32, bfloat16 or float16 (as a dtype or its name)."""
    try:
        dtype = None if value is None else jnp.dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.name not in LOAD_DTYPES:
        fail(name, value, f"must be a floating dtype, one of {list(LOAD_DTYPES)}")
    return dtype


def _nested_ints(name: str, rows: list | tuple) -> np.ndarray:
    """A list of ints, or a list of equal-length lists of ints, as an object array of those ints (so
    that ids of any size are compared exactly)."""
    if not all(is_integer(t) for t in rows):
        if not all(isinstance(r, (list, tuple)) for r in rows):
            fail(name, rows, "must be a list of integer token ids or a list of such lists")
        bad = next(((i, t) for i, r in enumerate(rows) for t in r if not is_integer(t)), None)
        if bad is not None:
            raise RequestError(f"{name}: row {bad[0]} holds a non-integer entry {show(bad[1])}")
        lengths = sorted({len(r) for r in rows})
        if len(lengths) > 1:
            raise RequestError(f"{name}: rows of different lengths {lengths}; a batch must be rectangular "
                               "(generate takes prompts of different lengths)")
    return np.array(rows, dtype=object)


def check_token_ids(tokens: Any, vocab_size: int, name: str = "tokens") -> np.ndarray:
    """Concrete token ids (a list, a list of equal-length lists, or an integer array; 1-D or 2-D) as an
    integer array, or RequestError naming the first bad entry and its index."""
    if isinstance(tokens, (list, tuple)):
        arr = _nested_ints(name, tokens)
    elif isinstance(tokens, (np.ndarray, jax.Array)):
        arr = np.asarray(tokens)
    else:
        fail(name, tokens, "must be a list of integer token ids or an integer array")
    if arr.ndim not in (1, 2):
        raise RequestError(f"{name}: token ids must be 1-D or 2-D, got shape {list(arr.shape)}")
    if arr.size == 0:
        raise RequestError(f"{name}: token ids are empty (shape {list(arr.shape)})")
    if arr.dtype.kind not in "iuO":
        raise RequestError(f"{name}: token ids must be integers, got dtype {arr.dtype}")
    bad = np.argwhere((arr < 0) | (arr >= vocab_size))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        raise RequestError(f"{name}: token id {int(arr[where])} at index {list(where)} is outside the "
                           f"vocabulary [0, {vocab_size})")
    return arr.astype(np.int64) if arr.dtype.kind == "O" else arr


def prompt_list(prompt_ids: Any, vocab_size: int) -> list[np.ndarray]:
    """Prompts as a list of non-empty 1-D int32 arrays.

    prompt_ids: a list of prompts (each a list of ints or a 1-D integer array), one prompt as a flat
    list of ints, or a 1-D (one prompt) / 2-D (one per row) integer array.
    """
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        arr = np.asarray(prompt_ids)
        if arr.ndim not in (1, 2):
            raise RequestError(f"prompt_ids array must be 1-D or 2-D, got shape {list(arr.shape)}")
        if arr.size == 0:
            raise RequestError(f"prompt_ids is empty (shape {list(arr.shape)})")
        rows = [arr] if arr.ndim == 1 else list(arr)
    elif isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) > 0:
        if all(is_integer(t) for t in prompt_ids):
            rows = [prompt_ids]
        elif all(isinstance(p, (list, tuple, np.ndarray, jax.Array)) for p in prompt_ids):
            rows = list(prompt_ids)
        else:
            fail("prompt_ids", prompt_ids, "holds non-integer entries; must be a list of prompts (lists of "
                 "ints) or one prompt (a list of ints)")
    else:
        fail("prompt_ids", prompt_ids, "must be a non-empty list of lists of ints, or a 1-D/2-D integer "
             f"array; got {type(prompt_ids).__name__}" + (" (empty)" if isinstance(prompt_ids, (list, tuple)) else ""))
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, (list, tuple)) and not all(is_integer(t) for t in row):
            raise RequestError(f"prompt {i} holds non-integer entries: {show(row)}")
        if np.ndim(row) != 1:
            raise RequestError(f"prompt {i} must be 1-D, got shape {list(np.shape(row))}")
        if len(row) == 0:
            raise RequestError(f"prompt {i} is empty")
        out.append(check_token_ids(np.asarray(row), vocab_size, f"prompt {i}").astype(np.int32))
    return out


def token_id_list(name: str, value: Any, vocab_size: int) -> tuple[int, ...]:
    """None or a list / tuple / set / 1-D integer array of token ids -> a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    elif isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 1:
        items = list(np.asarray(value))
    else:
        fail(name, value, "must be None or a list of token ids, e.g. [2]")
    for i, t in enumerate(items):
        if not is_integer(t) or not 0 <= t < vocab_size:
            fail(f"{name}[{i}]", t, f"must be an integer token id in the vocabulary [0, {vocab_size})")
    return tuple(int(t) for t in items)
