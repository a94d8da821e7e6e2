"""nemoh.load: a Hugging Face NemotronH checkpoint directory -> ModelParams.

Reads config.json, then each tensor on its own (HF keys backbone.layers.{i}.mixer.*), checks its
shape and dtype against the config, converts it, and drops the host copy before the next one, so host
memory stays near the size of the result plus one layer's stack of experts: a layer's experts are read
into one host stack per stored tensor and converted on the device in one go, stacked along a leading
axis. Quantised (ModelOpt) linears stay packed. Only JSON and safetensors are read: nothing in the checkpoint runs.
A missing, unexpected, mis-shaped or unreadable tensor raises CheckpointError naming it and its file,
and so does a tensor holding NaN or Inf (checked on the device, one small read at the end).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nemoh import validate
from nemoh.config import ATTENTION, MAMBA, MLP, MOE, NemotronHConfig
from nemoh.errors import CheckpointError
from nemoh.io.deferred import Stacked, Whole, check_one_format, place
from nemoh.io.modelopt import QuantSpec, abstract_linear, read_kv_scales, read_linear, read_stored_linear
from nemoh.io.persist import is_saved_params, restore
from nemoh.io.tensor_source import TensorSource
from nemoh.layers.attention import AttentionParams
from nemoh.layers.mamba2 import MambaParams
from nemoh.layers.mlp import MLPParams
from nemoh.layers.moe import MoEParams
from nemoh.model import ModelParams
from nemoh.sharding.params import check_params
from nemoh.sharding.placement import make_placement
from pallas_kernels import FP8Weight

FLOAT_DTYPES = ("F32", "BF16", "F16")
EMBEDDING_KEYS = ("backbone.embeddings.weight", "backbone.embedding.weight")
PROGRESS_MIN_BYTES = 1 << 30  # show a progress bar from 1 GiB of weights on
IGNORED_PREFIXES = ("mtp.",)  # multi-token-prediction heads: not used for decoding


@functools.partial(jax.jit, static_argnums=1)
def _finite_rows(x: jax.Array, rows: int) -> jax.Array:
    """x [rows, ...] (any shape when rows is 1) -> [rows] bool: whether each row is all finite."""
    return jnp.all(jnp.isfinite(x.reshape(rows, -1)), axis=1)


class _Reader:
    """Reads the tensors of one checkpoint in the param dtype, with the quantisation spec applied, and
    keeps a device-side "all finite" flag per float tensor (as converted) for `check_finite`.

    `build_params` asks a reader for tensors by HF name; nemoh.random_params passes one that draws them.
    """

    def __init__(self, src: TensorSource, spec: QuantSpec | None, dtype, activation_quant: bool = False):
        self.src, self.spec, self.dtype, self.activation_quant = src, spec, dtype, activation_quant
        self.finite: list[tuple[tuple[str, ...], jax.Array]] = []  # (names, one flag each)

    def _track(self, names: tuple[str, ...], x: jax.Array) -> None:
        """One flag per name: x's leading axis runs over them (one name: x is that tensor, whole)."""
        self.finite.append((names, _finite_rows(x, len(names))))

    def _track_weight(self, modules: list[str], w) -> None:
        """Flags for the float values of a linear weight, one per module stacked along its leading axis:
        dense arrays and FP8 codes (NVFP4 codes cannot be NaN; its scales are checked on read)."""
        if isinstance(w, (jax.Array, FP8Weight)):
            self._track(tuple(m + ".weight" for m in modules), w.data if isinstance(w, FP8Weight) else w)

    def has(self, name: str) -> bool:
        return self.src.has(name)

    def kv_scales(self, module_prefix: str) -> None:
        # FP8 KV-cache scales (k_proj.k_scale / v_proj.v_scale) are checked, then left unused: nemoh keeps
        # the KV pages in the model dtype, which is at least as precise as the FP8 cache they calibrate.
        read_kv_scales(self.src, module_prefix)

    def vector(self, name: str, shape: tuple[int, ...], dtype=None) -> jax.Array:
        x = jnp.asarray(self.src.get(name, shape=shape, dtypes=FLOAT_DTYPES), dtype or self.dtype)
        self._track((name,), x)
        return x

    def linear(self, module: str, out_dim: int, in_dim: int):
        w = read_linear(self.src, module, self.spec, (out_dim, in_dim), self.dtype, self.activation_quant)
        self._track_weight([module], w)
        return w

    def check_finite(self) -> None:
        """CheckpointError naming the first tensor (and its file) that holds NaN or Inf."""
        flags = jax.device_get([flag for _, flag in self.finite])
        bad = next((name for (names, _), fine in zip(self.finite, flags) for name, ok in zip(names, fine) if not ok),
                   None)
        if bad is not None:
            raise CheckpointError(f"tensor {bad} in {self.src.file_of(bad)}: holds NaN or Inf values "
                                  f"(as loaded in {self.dtype})")

    def stacked_linear(self, modules: list[str], out_dim: int, in_dim: int):
        """One [E, out, in] weight (of any type) from E per-expert modules, all in one format. The experts
        are read and checked on the host (as views of the file) into one stack per stored tensor, which is
        converted and moved to the device once: one transfer and one conversion per layer, not per expert."""
        shape = (out_dim, in_dim)
        read = lambda m: read_stored_linear(self.src, m, self.spec, shape, self.activation_quant, views=True)
        first = read(modules[0])
        tree = jax.tree.structure(first)
        stacks = [np.empty((len(modules), *np.shape(a)), np.asarray(a).dtype) for a in jax.tree.leaves(first)]
        for j, m in enumerate(modules):
            one = first if j == 0 else read(m)
            if jax.tree.structure(one) != tree:
                abstract = lambda name: abstract_linear(self.spec, name, shape, self.dtype, self.activation_quant)
                check_one_format(m, abstract(m), modules[0], abstract(modules[0]))
            for stack, a in zip(stacks, jax.tree.leaves(one)):
                stack[j] = a
        w = jax.tree.unflatten(tree, stacks).to_weight(self.dtype)
        self._track_weight(modules, w)
        return w


def _on_host(make):
    """make() run with the host's CPU device as jax's default (the checkpoint's bytes are converted there)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return make()


class _DeferredReader(_Reader):
    """The reader for a mesh: hands out Deferred leaves (nemoh.io.deferred), read and converted on the
    host only when they are placed, each device's shard from its own experts."""

    def kv_scales(self, module_prefix: str) -> None:
        _on_host(lambda: _Reader.kv_scales(self, module_prefix))

    def vector(self, name: str, shape: tuple[int, ...], dtype=None):
        dtype = dtype or self.dtype
        return Whole(jax.ShapeDtypeStruct(tuple(shape), dtype),
                     lambda: _on_host(lambda: _Reader.vector(self, name, shape, dtype))).tree()

    def linear(self, module: str, out_dim: int, in_dim: int):
        return Whole(abstract_linear(self.spec, module, (out_dim, in_dim), self.dtype, self.activation_quant),
                     lambda: _on_host(lambda: _Reader.linear(self, module, out_dim, in_dim))).tree()

    def stacked_linear(self, modules: list[str], out_dim: int, in_dim: int):
        one = abstract_linear(self.spec, modules[0], (out_dim, in_dim), self.dtype, self.activation_quant)
        stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct((len(modules), *a.shape), a.dtype), one)
        return Stacked(stack, lambda j: _on_host(lambda: _Reader.linear(self, modules[j], out_dim, in_dim)),
                       lambda j: modules[j]).tree()


def _mamba(r: _Reader, cfg: NemotronHConfig, pre: str) -> MambaParams:
    H, nh, C, K = cfg.hidden_size, cfg.mamba_num_heads, cfg.conv_dim, cfg.conv_kernel
    conv = r.vector(f"{pre}.mixer.conv1d.weight", (C, 1, K)).reshape(C, K)
    bias_name = f"{pre}.mixer.conv1d.bias"
    if cfg.use_conv_bias:
        bias = r.vector(bias_name, (C,))
    elif r.has(bias_name):
        raise CheckpointError(f"tensor {bias_name} in {r.src.file_of(bias_name)}: present, but use_conv_bias is false")
    else:
        bias = None
    f32 = jnp.float32
    return MambaParams(
        norm=r.vector(f"{pre}.norm.weight", (H,)),
        in_proj=r.linear(f"{pre}.mixer.in_proj", cfg.in_proj_dim, H),
        conv_weight=conv,
        conv_bias=bias,
        A_log=r.vector(f"{pre}.mixer.A_log", (nh,), f32),
        D=r.vector(f"{pre}.mixer.D", (nh,), f32),
        dt_bias=r.vector(f"{pre}.mixer.dt_bias", (nh,), f32),
        gate_norm=r.vector(f"{pre}.mixer.norm.weight", (cfg.mamba_intermediate,)),
        out_proj=r.linear(f"{pre}.mixer.out_proj", H, cfg.mamba_intermediate),
    )


def _attention(r: _Reader, cfg: NemotronHConfig, pre: str) -> AttentionParams:
    r.kv_scales(f"{pre}.mixer")
    H, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return AttentionParams(
        norm=r.vector(f"{pre}.norm.weight", (H,)),
        q_proj=r.linear(f"{pre}.mixer.q_proj", q, H),
        k_proj=r.linear(f"{pre}.mixer.k_proj", kv, H),
        v_proj=r.linear(f"{pre}.mixer.v_proj", kv, H),
        o_proj=r.linear(f"{pre}.mixer.o_proj", H, q),
    )


def _mlp(r: _Reader, cfg: NemotronHConfig, pre: str) -> MLPParams:
    H, F = cfg.hidden_size, cfg.intermediate_size
    return MLPParams(
        norm=r.vector(f"{pre}.norm.weight", (H,)),
        up_proj=r.linear(f"{pre}.mixer.up_proj", F, H),
        down_proj=r.linear(f"{pre}.mixer.down_proj", H, F),
    )


def _moe(r: _Reader, cfg: NemotronHConfig, pre: str) -> MoEParams:
    H, E, F, L = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_input_size
    m = f"{pre}.mixer"
    shared = cfg.n_shared_experts > 0
    latent = cfg.moe_latent_size is not None
    Fs = cfg.moe_shared_expert_intermediate_size
    return MoEParams(
        norm=r.vector(f"{pre}.norm.weight", (H,)),
        router=r.vector(f"{m}.gate.weight", (E, H), jnp.float32),
        router_bias=r.vector(f"{m}.gate.e_score_correction_bias", (E,), jnp.float32),
        experts_up=r.stacked_linear([f"{m}.experts.{j}.up_proj" for j in range(E)], F, L),
        experts_down=r.stacked_linear([f"{m}.experts.{j}.down_proj" for j in range(E)], L, F),
        shared_up=r.linear(f"{m}.shared_experts.up_proj", Fs, H) if shared else None,
        shared_down=r.linear(f"{m}.shared_experts.down_proj", H, Fs) if shared else None,
        latent_in=r.linear(f"{m}.fc1_latent_proj", L, H) if latent else None,
        latent_out=r.linear(f"{m}.fc2_latent_proj", H, L) if latent else None,
    )


_BUILDERS = {MAMBA: _mamba, ATTENTION: _attention, MLP: _mlp, MOE: _moe}


def _total_bytes(src: TensorSource) -> int:
    return sum((src.directory / f).stat().st_size for f in {src.file_of(n) for n in src.names()})


def build_params(cfg: NemotronHConfig, reader, embed_key: str = EMBEDDING_KEYS[0], tied: bool | None = None,
                 progress_desc: str | None = None) -> ModelParams:
    """ModelParams of `cfg` from a reader that hands out tensors by HF name (has, vector, linear,
    stacked_linear, kv_scales). tied: lm_head absent (default: cfg.tie_word_embeddings)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    embed = reader.vector(embed_key, (V, H))
    kinds = list(enumerate(cfg.layer_kinds))
    if progress_desc:
        from tqdm import tqdm

        kinds = tqdm(kinds, desc=progress_desc, unit="layer")
    layers = tuple(_BUILDERS[kind](reader, cfg, f"backbone.layers.{i}") for i, kind in kinds)
    tied = cfg.tie_word_embeddings if tied is None else tied
    return ModelParams(
        config=cfg,
        embed=embed,
        norm_f=reader.vector("backbone.norm_f.weight", (H,)),
        lm_head=None if tied else reader.linear("lm_head", V, H),
        layers=layers,
    )


def load(path: str | Path, dtype=None, *, progress: bool | None = None, sharding=None,
         activation_quant: bool = False, mesh=None, rules=None) -> ModelParams:
    """Load a NemotronH checkpoint directory: Hugging Face layout (config.json + model.safetensors or an
    index of shards, ModelOpt-quantised or not), or a directory written by nemoh.save.

    dtype: the dtype of dense weights and activations, float32, bfloat16 or float16 (router and SSM
    parameters stay fp32); None means bfloat16 for a Hugging Face checkpoint and the saved dtype for a
    nemoh.save directory, which is restored exactly as saved (another dtype is refused).
    progress: show a progress bar (default: only for checkpoints of 1 GiB and more).
    sharding: where a nemoh.save directory's leaves go (see nemoh.io.persist.restore).
    activation_quant: where a ModelOpt config quantises a linear's activations (FP8, NVFP4), run it so:
    FP8 as W8A8 and NVFP4 as emulated W4A4, with the stored input_scale (docs/checkpoint_formats.md).
    Default False: every quantised linear is weight-only (W8A16 / W4A16) and input scales go unused.
    mesh, rules: lay the params out over a jax Mesh by the rules (nemoh.sharding; default
    DEFAULT_RULES): every tensor goes straight onto its shards as it is read, each device reading only
    its own experts; a mesh axis that does not divide a dim it splits raises MeshError (naming the
    tensor, the dim and the axis) before anything is read.
    """
    path = validate.path("path", path)
    dtype = None if dtype is None else validate.float_dtype("dtype", dtype)
    validate.optional(validate.boolean, "progress", progress)
    placement = None if mesh is None else make_placement(mesh, rules)
    if placement is None and rules is not None:
        validate.fail("rules", rules, "needs a mesh: pass mesh=...")
    if placement is not None and sharding is not None:
        validate.fail("sharding", sharding, "give sharding or mesh, not both")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if is_saved_params(path):
        params = restore(path, sharding=sharding, placement=placement)
        if dtype is not None and jnp.dtype(dtype) != params.dtype:
            raise CheckpointError(f"{path} was saved in {params.dtype}; load it with dtype=None (or "
                                  f"{params.dtype}) rather than {jnp.dtype(dtype)}")
        return params
    dtype = jnp.bfloat16 if dtype is None else dtype
    cfg = NemotronHConfig.from_json_file(path / "config.json")
    src = TensorSource(path)
    reader = (_Reader if placement is None else _DeferredReader)(src, QuantSpec.from_dir(path), jnp.dtype(dtype),
                                                                 activation_quant)

    embed_key = next((k for k in EMBEDDING_KEYS if src.has(k)), None)
    if embed_key is None:
        raise CheckpointError(f"tensor {EMBEDDING_KEYS[0]} (or {EMBEDDING_KEYS[1]}) is missing from {path}")
    if progress is None:
        progress = _total_bytes(src) >= PROGRESS_MIN_BYTES
    tied = cfg.tie_word_embeddings and not src.has("lm_head.weight")
    if placement is None:
        params = build_params(cfg, reader, embed_key, tied, f"loading {path.name}" if progress else None).committed()
    else:  # the layout is checked (MeshError) before anything is read
        params = build_params(cfg, reader, embed_key, tied)
        params = place(params, check_params(params, placement), f"loading {path.name}" if progress else None)
    for name in src.unconsumed():
        if name.startswith(IGNORED_PREFIXES):
            src.mark_used(name)
    unexpected = src.unconsumed()
    if unexpected:
        shown = ", ".join(f"{n} (in {src.file_of(n)})" for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(f"unexpected tensors not used by the {cfg.pattern!r} model: {shown}{more}")
    reader.check_finite()
    return params
