"""The research API: layers carry their behaviour (the layer protocol), surgery helpers, penzai and
flax.nnx interop, the examples, the one-screen repr, and named errors for layers that break the
protocol."""

from __future__ import annotations

import dataclasses
import html
import runpy
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import nemoh
from nemoh import surgery
from nemoh.engine.prefill import prefill
from nemoh.layers.attention import KVPages
from nemoh.layers.mamba2 import MambaParams, MambaState, mamba2_mixer
from nemoh.layers.mlp import MLPParams, relu2_mlp

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny-nemotron-h"
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 1, 250, 31, 8], [9, 4]]
NEW = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UserMLP(nemoh.Stateless):
    """The MLP written as a user layer on nemoh's pure relu2_mlp."""

    norm: jax.Array
    up: jax.Array
    down: jax.Array

    def mix(self, h, cfg, state, ctx):
        return relu2_mlp(self.up, self.down, h), state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UserMamba:
    """Mamba2 written as a user stateful layer on nemoh's pure mamba2_mixer and MambaState."""

    inner: MambaParams

    @property
    def norm(self):
        return self.inner.norm

    def init_state(self, cfg, shape):
        return MambaState.zeros(cfg, shape.batch, shape.dtype)

    def mix(self, h, cfg, state, ctx):
        return mamba2_mixer(self.inner, h, cfg, state, ctx.valid_len)


@pytest.fixture(scope="module")
def params():
    return nemoh.load(TINY, dtype=jnp.float32)


@pytest.fixture(scope="module")
def original(params):
    return nemoh.generate(params, PROMPTS, max_new_tokens=NEW, ignore_eos=True)


def _run(params):
    return nemoh.generate(params, PROMPTS, max_new_tokens=NEW, ignore_eos=True)


def test_mlp_and_mamba_as_user_layers_give_the_same_tokens(params, original):
    swapped = surgery.replace(params, MLPParams, lambda i, old: UserMLP(old.norm, old.up_proj, old.down_proj))
    swapped = surgery.replace(swapped, MambaParams, lambda i, old: UserMamba(old))
    assert not any(isinstance(l, (MLPParams, MambaParams)) for l in swapped.layers)
    assert isinstance(params.layers[0], MambaParams)  # the old params are untouched
    assert _run(swapped) == original
    carry = prefill(swapped, PROMPTS, max_new_tokens=NEW)
    assert isinstance(carry.states[0], MambaState)  # the engine asked the user layer for its state


def test_surgery_select_drop_insert(params):
    assert surgery.select(params, "mamba") == [i for i, k in enumerate(params.config.layer_kinds) if k == "mamba"]
    assert surgery.select(params, MLPParams) == surgery.select(params, "mlp")
    assert surgery.select(params, slice(1, 3)) == [1, 2] and surgery.select(params, -1) == [len(params.layers) - 1]
    assert surgery.select(params, lambda i, l: i % 3 == 0) == list(range(0, len(params.layers), 3))
    dropped = surgery.drop(params, "moe")
    assert "E" not in dropped.config.pattern and len(dropped.layers) == len(params.layers) - params.config.pattern.count("E")
    again = surgery.insert(dropped, 1, params.layers[2])
    assert again.config.pattern[1] == params.config.pattern[2]
    with pytest.raises(nemoh.RequestError, match="where=99"):
        surgery.select(params, 99)
    with pytest.raises(nemoh.RequestError, match="no layers"):
        surgery.drop(params, slice(None))


def test_penzai_selection_composes(params):
    from penzai import pz

    via_penzai = pz.select(params).at_instances_of(MLPParams).apply(
        lambda old: UserMLP(old.norm, old.up_proj, old.down_proj))
    via_surgery = surgery.replace(params, MLPParams, lambda i, old: UserMLP(old.norm, old.up_proj, old.down_proj))
    assert jax.tree.structure(via_penzai.layers) == jax.tree.structure(via_surgery.layers)
    assert pz.select(params).at_instances_of(MLPParams).count() == params.config.pattern.count("-")


def test_flax_nnx_layer_under_jit_and_decode(params, original):
    from flax import nnx
    from nemoh.layers.nnx_layer import NNXLayer

    class NNXMLP(nnx.Module):
        def __init__(self, up, down):
            self.up, self.down = nnx.Param(up), nnx.Param(down)

        def __call__(self, h, cfg, state, ctx):
            return relu2_mlp(self.up[...], self.down[...], h), state

    swapped = surgery.replace(params, MLPParams,
                              lambda i, old: NNXLayer.wrap(NNXMLP(old.up_proj, old.down_proj), old.norm))
    assert _run(swapped) == original


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoMixer:
    norm: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrowsItsState:
    norm: jax.Array

    def init_state(self, cfg, shape):
        return jnp.zeros((shape.batch, 4))

    def mix(self, h, cfg, state, ctx):
        return h, None if state is None else jnp.zeros((state.shape[0], 5))


def test_layers_that_break_the_protocol_are_named(params):
    layers = list(params.layers)
    layers[4] = NoMixer(layers[4].norm)
    broken = dataclasses.replace(params, layers=tuple(layers))
    with pytest.raises(nemoh.LayerError, match=r"layer 4 \(NoMixer\) does not follow the layer protocol: no mix"):
        nemoh.generate(broken, PROMPTS, max_new_tokens=2)
    layers[4] = GrowsItsState(layers[4].norm)
    with pytest.raises(nemoh.LayerError, match=r"layer 4 \(GrowsItsState\): its mixer returned a state of another"):
        nemoh.generate(dataclasses.replace(params, layers=tuple(layers)), PROMPTS, max_new_tokens=2)
    with pytest.raises(nemoh.LayerError, match="layer 1 \\(NoMixer\\)"):
        surgery.insert(params, 1, NoMixer(params.norm_f))


def test_repr_is_one_screen_and_treescope_renders(params, monkeypatch):
    text = repr(params)
    assert len(text) < 1000 and "M*EM-EME" in text and "moe: 3 layer(s)" in text
    assert "treescope-container" in params._repr_html_()  # treescope's own view (a test dependency)
    monkeypatch.setitem(sys.modules, "treescope", None)  # without treescope: the repr, escaped
    assert params._repr_html_() == f"<pre>{html.escape(text)}</pre>"


def test_quickstart_example_runs(monkeypatch):
    monkeypatch.chdir(REPO)
    texts = runpy.run_path(str(REPO / "examples" / "quickstart.py"))["main"]()
    assert texts[0].strip() and all(c.isprintable() or c.isspace() for c in texts[0])  # the continuation


def test_layer_swap_example_runs(monkeypatch):
    """Mamba -> attention (the carry holds a KV pool for that layer), a user recurrent mixer carrying its
    own state, a dropped layer: each generates through prefill and decode."""
    monkeypatch.chdir(REPO)
    out = runpy.run_path(str(REPO / "examples" / "layer_swap.py"))["main"]()
    assert isinstance(out["swapped_state"], KVPages)
    assert out["recurrent_state"].shape == (1, 16) and bool(jnp.any(out["recurrent_state"] != 0))
    tokens = out["tokens"]
    assert all(len(t) == 6 for t in tokens.values()) and tokens["mamba_to_attention"] != tokens["original"]
