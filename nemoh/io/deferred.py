"""Deferred leaves: params whose tensors are made (read from a checkpoint, or drawn) only once their
sharding is known, then placed shard by shard, so that no host holds a whole model, nor a whole
stack of experts.

A reader for a mesh hands `build_params` Deferred leaves, each naming the Source that makes it;
Placement.shardings works on such a tree as on arrays (MeshError before anything is made), and
`place` asks every source for its leaves on their shardings:
  Whole    makes its value at once (one tensor, or one module's FP8 / NVFP4 tensors) and sends each
           device its slice;
  Stacked  makes expert j alone: for each block of experts some device holds, the block is made on
           the host, each device holding it gets its slice, and the block is dropped;
  Drawn    draws its value on the devices, straight into its shardings.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from nemoh.errors import CheckpointError
from pallas_kernels import is_quantized


class Deferred:
    """A leaf still to be made: shape, dtype, the source that makes it and its index among the
    source's leaves. `reshape` (the loader reshapes conv weights) applies when it is placed."""

    __slots__ = ("shape", "dtype", "source", "index")

    def __init__(self, shape, dtype, source, index: int):
        self.shape, self.dtype, self.source, self.index = tuple(shape), np.dtype(dtype), source, index

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape) -> "Deferred":
        return Deferred(shape, self.dtype, self.source, self.index)


class Source:
    """Makes the leaves of one value (an array or a quantised weight) whose abstract form is `abstract`
    (ShapeDtypeStruct leaves); `tree()` is that value with Deferred leaves."""

    def __init__(self, abstract):
        self.abstract = abstract
        self.treedef = jax.tree.structure(abstract)

    def tree(self):
        return self.treedef.unflatten([Deferred(a.shape, a.dtype, self, i)
                                       for i, a in enumerate(jax.tree.leaves(self.abstract))])

    def place(self, leaves: list[Deferred], shardings: list) -> list[jax.Array]:
        raise NotImplementedError


class Whole(Source):
    """make() -> the whole value."""

    def __init__(self, abstract, make: Callable[[], object]):
        super().__init__(abstract)
        self.make = make

    def place(self, leaves, shardings):
        made = jax.tree.leaves(self.make())
        return [jax.device_put(made[d.index].reshape(d.shape), s) for d, s in zip(leaves, shardings)]


def check_one_format(name: str, value, first_name: str, first) -> None:
    """CheckpointError unless expert `name`'s value is stored like `first` (expert `first_name`'s, or the
    stack's abstract value): one format, with or without an input_scale, since a layer's experts stack
    into one array per leaf."""
    if jax.tree.structure(value) != jax.tree.structure(first):
        describe = lambda v: (f"{type(v).__name__} (input_scale used: {v.input_scale is not None})" if is_quantized(v)
                              else "a dense array")
        raise CheckpointError(f"module {name}: stored as {describe(value)} but {first_name} as {describe(first)}; "
                              "nemoh stacks a layer's experts in one format")


class Stacked(Source):
    """make(j) -> expert j's value (abstract: the stack's); name(j) names expert j in errors."""

    def __init__(self, abstract, make: Callable[[int], object], name: Callable[[int], str]):
        super().__init__(abstract)
        self.make, self.name = make, name
        self.count = jax.tree.leaves(abstract)[0].shape[0]

    def _block(self, start: int, stop: int) -> list[np.ndarray]:
        experts = []
        for j in range(start, stop):
            one = self.make(j)
            check_one_format(self.name(j), one, self.name(0), self.abstract)
            experts.append([np.asarray(a) for a in jax.tree.leaves(one)])
        return [np.stack(leaf) for leaf in zip(*experts)]

    def place(self, leaves, shardings):
        index_maps = [s.addressable_devices_indices_map(d.shape) for d, s in zip(leaves, shardings)]
        span = lambda idx: idx[0].indices(self.count)[:2]
        pieces: list[dict] = [{} for _ in leaves]
        for start, stop in sorted({span(idx) for m in index_maps for idx in m.values()}):
            block = self._block(start, stop)
            for d, m, got in zip(leaves, index_maps, pieces):
                for device, idx in m.items():
                    if span(idx) == (start, stop):
                        got[device] = jax.device_put(block[d.index][(slice(None), *idx[1:])], device)
        return [jax.make_array_from_single_device_arrays(d.shape, s, list(got.values()))
                for d, s, got in zip(leaves, shardings, pieces)]


class Drawn(Source):
    """draw(shardings) -> the value, made on the devices with those shardings (a tree like the value)."""

    def __init__(self, abstract, draw: Callable[[object], object]):
        super().__init__(abstract)
        self.draw = draw

    def place(self, leaves, shardings):
        ordered = [s for _, s in sorted(zip([d.index for d in leaves], shardings), key=lambda p: p[0])]
        made = jax.tree.leaves(self.draw(self.treedef.unflatten(ordered)))
        return [made[d.index] for d in leaves]


def place(tree, shardings, progress_desc: str | None = None):
    """`tree` with every Deferred leaf made and placed on its sharding (`shardings`: a tree like `tree`);
    progress_desc: show a progress bar over the sources with this label."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    by_source: dict[int, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Deferred):
            by_source.setdefault(id(leaf.source), []).append(i)
    out = list(leaves)
    sources = by_source.values()
    if progress_desc:
        from tqdm import tqdm

        sources = tqdm(sources, desc=progress_desc, unit="tensor")
    for positions in sources:
        source = leaves[positions[0]].source
        made = source.place([leaves[i] for i in positions], [targets[i] for i in positions])
        for i, array in zip(positions, made):
            out[i] = array
    return treedef.unflatten(out)
