"""Train checkpoints/alice-nemotron-h: a tiny NemotronH (every layer kind) that writes Alice-like English.

Run from the repo root after `bash scripts/setup.sh` (which installs the `train` extra, optax):

    .venv/bin/python checkpoints/make_demo.py                 # the shipped checkpoint (see checkpoints/README.md)
    .venv/bin/python checkpoints/make_demo.py --steps 20 --corpus-chars 20000 --out /tmp/demo   # a quick try

Steps: read the corpus (Alice's Adventures in Wonderland, checkpoints/corpus/alice29.txt), unwrap its
paragraphs, train a byte-level BPE tokenizer on it with the `tokenizers` library, initialise the model
from a fixed seed, train it with optax AdamW through jax.grad of nemoh's own layer stack
(`nemoh.model.run_layers`, the code that serves inference), and write a Hugging Face checkpoint
(config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that
`nemoh.load` and transformers both read. Every random choice comes from --seed, so a rerun on the same
machine and software writes the same files.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nemoh.config import ATTENTION, MAMBA, MLP, MOE, NemotronHConfig
from nemoh.layers.attention import AttentionParams
from nemoh.layers.context import TokenContext
from nemoh.layers.mamba2 import MambaParams
from nemoh.layers.mlp import MLPParams
from nemoh.layers.moe import MoEParams
from nemoh.model import ModelParams, logits_from_hidden, run_layers

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus" / "alice29.txt"
OUT_DIR = HERE / "alice-nemotron-h"

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4
# ChatML-style, with the BOS token first (rendered by transformers and by nemoh.text.chat alike).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' ~ message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# config.json fields (transformers' NemotronHConfig names). time_step_min is tiny so that transformers'
# full-sequence dt clamp (see README, "Semantics worth knowing") never fires.
CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "vocab_size": 2048, "hidden_size": 128, "hybrid_override_pattern": "ME*M-M*E", "num_hidden_layers": 8,
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "residual_in_fp32": False,
    "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 32, "n_groups": 2, "expand": 2,
    "conv_kernel": 4, "chunk_size": 32, "use_conv_bias": True, "use_bias": False, "mamba_hidden_act": "silu",
    "time_step_min": 1e-7, "time_step_max": 0.1, "time_step_floor": 1e-4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": False,
    "intermediate_size": 384, "mlp_hidden_act": "relu2", "mlp_bias": False,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 128, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0,
    "max_position_embeddings": 4096,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "dtype": "bfloat16",
}


# ---- corpus and tokenizer --------------------------------------------------------------------------
def prepare_text(raw: str) -> str:
    """The corpus as training text: CRLF -> LF, each paragraph unwrapped onto one line, paragraphs
    separated by a blank line, runs of spaces collapsed, and the `...' quotes written '...'."""
    paragraphs = (re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", raw.replace("\r\n", "\n")))
    return "\n\n".join(p for p in paragraphs if p).replace("`", "'")


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style: any UTF-8 text round-trips) with SPECIAL_TOKENS first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: special tokens and the chat template."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "model_max_length": CONFIG["max_position_embeddings"], "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False}


# ---- model -----------------------------------------------------------------------------------------
def init_params(cfg: NemotronHConfig, seed: int) -> ModelParams:
    """Fresh float32 params: linears N(0, 0.02) (output projections scaled by 1/sqrt(2 * layers)), norms
    one, Mamba A in [-16, -1], dt in [1e-3, 0.1] log-uniform, D one, router bias zero."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64 * (cfg.num_layers + 1)))
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.num_layers)
    H, f32 = cfg.hidden_size, jnp.float32

    def normal(*shape, scale=std):
        return scale * jax.random.normal(next(keys), shape, f32)

    def uniform(lo, hi, *shape):
        return jax.random.uniform(next(keys), shape, f32, lo, hi)

    def mamba():
        nh, C, K = cfg.mamba_num_heads, cfg.conv_dim, cfg.conv_kernel
        dt = jnp.exp(uniform(math.log(1e-3), math.log(0.1), nh))
        return MambaParams(norm=jnp.ones(H), in_proj=normal(cfg.in_proj_dim, H),
                           conv_weight=uniform(-K**-0.5, K**-0.5, C, K), conv_bias=uniform(-K**-0.5, K**-0.5, C),
                           A_log=jnp.log(uniform(1.0, 16.0, nh)), D=jnp.ones(nh), dt_bias=dt + jnp.log(-jnp.expm1(-dt)),
                           gate_norm=jnp.ones(cfg.mamba_intermediate), out_proj=normal(H, cfg.mamba_intermediate, scale=out_std))

    def attention():
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return AttentionParams(norm=jnp.ones(H), q_proj=normal(q, H), k_proj=normal(kv, H), v_proj=normal(kv, H),
                               o_proj=normal(H, q, scale=out_std))

    def mlp():
        F = cfg.intermediate_size
        return MLPParams(norm=jnp.ones(H), up_proj=normal(F, H), down_proj=normal(H, F, scale=out_std))

    def moe():
        E, F, Fs = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
        return MoEParams(norm=jnp.ones(H), router=normal(E, H), router_bias=jnp.zeros(E),
                         experts_up=normal(E, F, H), experts_down=normal(E, H, F, scale=out_std),
                         shared_up=normal(Fs, H), shared_down=normal(H, Fs, scale=out_std),
                         latent_in=None, latent_out=None)

    build = {MAMBA: mamba, ATTENTION: attention, MLP: mlp, MOE: moe}
    return ModelParams(config=cfg, embed=normal(cfg.vocab_size, H), norm_f=jnp.ones(H),
                       lm_head=normal(cfg.vocab_size, H), layers=tuple(build[k]() for k in cfg.layer_kinds))


def loss_fn(params: ModelParams, window: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of window [b, T+1] int32 (inputs window[:, :-1], targets window[:, 1:])."""
    inputs, targets = window[:, :-1], window[:, 1:]
    b, T = inputs.shape
    h, _ = run_layers(params, inputs, TokenContext.full(b, T), None)
    logp = jax.nn.log_softmax(logits_from_hidden(params, h), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_optimizer(steps: int, lr: float, warmup: int) -> optax.GradientTransformation:
    """AdamW (weight decay 0.1 on matrices only), global-norm clip 1, linear warmup (at most half the
    steps) then cosine decay to lr/10."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, steps // 2), steps, lr / 10)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))


def sample_windows(ids: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> np.ndarray:
    """batch random windows [batch, seq_len + 1] of the token stream `ids`."""
    starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
    return np.stack([ids[s : s + seq_len + 1] for s in starts]).astype(np.int32)


def train(params: ModelParams, train_ids: np.ndarray, val_ids: np.ndarray, *, steps: int, batch: int,
          seq_len: int, lr: float, warmup: int, seed: int, log_every: int, log=print) -> tuple[ModelParams, list[dict]]:
    """Train for `steps` AdamW steps on random windows of train_ids. Returns the params and the loss
    curve: one {step, train_loss (mean since the last entry), val_loss (fixed val windows), seconds}
    per log_every steps and at the last step."""
    optimizer = make_optimizer(steps, lr, warmup)

    @jax.jit
    def step(params, opt_state, window):
        loss, grads = jax.value_and_grad(loss_fn)(params, window)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    val_loss = jax.jit(loss_fn)
    rng = np.random.default_rng(seed)
    val = sample_windows(val_ids, np.random.default_rng(seed + 1), batch, seq_len)
    opt_state = optimizer.init(params)
    curve, pending, t0 = [], [], time.perf_counter()
    for i in range(1, steps + 1):
        params, opt_state, loss = step(params, opt_state, sample_windows(train_ids, rng, batch, seq_len))
        pending.append(loss)
        if i % log_every == 0 or i == steps:
            entry = {"step": i, "train_loss": float(np.mean(jax.device_get(pending))),
                     "val_loss": float(val_loss(params, val)), "seconds": round(time.perf_counter() - t0, 1)}
            curve.append(entry)
            pending = []
            log(f"step {i:5d}  train {entry['train_loss']:.3f}  val {entry['val_loss']:.3f}  {entry['seconds']:.0f} s")
    return params, curve


# ---- Hugging Face checkpoint -----------------------------------------------------------------------
def hf_tensors(params: ModelParams) -> dict[str, np.ndarray]:
    """ModelParams -> {HF tensor name: float32 array} (the keys and shapes nemoh.load reads)."""
    cfg = params.config
    out = {"backbone.embeddings.weight": params.embed, "backbone.norm_f.weight": params.norm_f,
           "lm_head.weight": params.lm_head}
    for i, (kind, p) in enumerate(zip(cfg.layer_kinds, params.layers)):
        pre, m = f"backbone.layers.{i}", f"backbone.layers.{i}.mixer"
        out[f"{pre}.norm.weight"] = p.norm
        if kind == MAMBA:
            out.update({f"{m}.in_proj.weight": p.in_proj, f"{m}.conv1d.weight": p.conv_weight[:, None, :],
                        f"{m}.conv1d.bias": p.conv_bias, f"{m}.A_log": p.A_log, f"{m}.D": p.D,
                        f"{m}.dt_bias": p.dt_bias, f"{m}.norm.weight": p.gate_norm, f"{m}.out_proj.weight": p.out_proj})
        elif kind == ATTENTION:
            out.update({f"{m}.{n}.weight": getattr(p, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        elif kind == MLP:
            out.update({f"{m}.up_proj.weight": p.up_proj, f"{m}.down_proj.weight": p.down_proj})
        else:
            out.update({f"{m}.gate.weight": p.router, f"{m}.gate.e_score_correction_bias": p.router_bias,
                        f"{m}.shared_experts.up_proj.weight": p.shared_up,
                        f"{m}.shared_experts.down_proj.weight": p.shared_down})
            for j in range(cfg.n_routed_experts):
                out[f"{m}.experts.{j}.up_proj.weight"] = p.experts_up[j]
                out[f"{m}.experts.{j}.down_proj.weight"] = p.experts_down[j]
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def write_checkpoint(out_dir: Path, params: ModelParams, tokenizer: Tokenizer, config: dict) -> None:
    """Write the HF checkpoint: bf16 tensors except the MoE router weight and bias (float32, as in the
    released checkpoints), plus the config, generation config and tokenizer files."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    keep_f32 = (".gate.weight", ".gate.e_score_correction_bias")
    tensors = {k: v if k.endswith(keep_f32) else v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(params).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for name, content in {"config.json": config, "generation_config.json": generation,
                          "tokenizer_config.json": tokenizer_config()}.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


# ---- entry point -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="checkpoints/make_demo.py", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="checkpoint directory to (re)write")
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="plain-text training corpus")
    ap.add_argument("--corpus-chars", type=int, default=None, help="train on the first N characters only")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--curve", type=Path, default=None, help="also write the loss curve here as JSON")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    text = prepare_text(args.corpus.read_text(encoding="utf-8"))[: args.corpus_chars]
    tokenizer = train_tokenizer(text, CONFIG["vocab_size"])
    ids = np.asarray(tokenizer.encode(text).ids, np.int32)
    split = int(len(ids) * 0.95)  # the last 5% of the book is held out for the validation loss
    cfg = NemotronHConfig.from_dict(CONFIG)
    print(f"corpus {len(text)} chars -> {len(ids)} tokens ({split} train); "
          f"{sum(x.size for x in jax.tree.leaves(init_params(cfg, args.seed)))} params", flush=True)
    params, curve = train(init_params(cfg, args.seed), ids[:split], ids[split:], steps=args.steps,
                          batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, seed=args.seed,
                          log_every=args.log_every, log=lambda s: print(s, flush=True))
    write_checkpoint(args.out, params, tokenizer, CONFIG)
    if args.curve is not None:
        args.curve.write_text(json.dumps(curve, indent=1) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return curve


if __name__ == "__main__":
    main()
