"""hf_worker: HF transformers' NemotronHForCausalLM run as nemoh's correctness oracle.

A standalone script for the oracle interpreter (Python 3.11 + torch + transformers); it never
imports nemoh or jax. Usage:

    python hf_worker.py REQUEST.json

REQUEST.json is {"output_dir": str, "jobs": [job, ...]}. Every job has a "kind":
  make    {config, out_dir, seed, dtype, layout_spelling}: build a randomly initialised checkpoint
  logits  {model_dir, prompts, dtype}: full-sequence logits of each prompt alone
  greedy  {model_dir, prompts, max_new_tokens, stop_token_ids, dtype}: greedy tokens + margins
  text    {model_dir, texts, chats}: AutoTokenizer's ids of each text, and of each chat
          {messages, add_generation_prompt, tools} its apply_chat_template text and ids
Results go to output_dir/result.json (one entry per job, in order) and output_dir/arrays.npz
(logits, keyed "j{job}_p{prompt}"). All jobs run in this one process, so torch is imported once.

Quirk handled here: transformers 5.24's full-sequence Mamba path clamps dt from below at
config.time_step_min (time_step_limit=(time_step_min, inf)); its one-token decode path does not,
and NemotronH's defined semantics clamp only to time_step_limit (default (0, inf)). Checkpoints
made here therefore default time_step_min to 1e-7, and every forward checks that the smallest
softplus(dt + dt_bias) it computed stayed above time_step_min, failing loudly otherwise.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoTokenizer, NemotronHConfig, NemotronHForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Defaults that keep the full-sequence dt clamp (see module docstring) from ever firing.
TINY_DT_DEFAULTS = {"time_step_min": 1e-7, "time_step_floor": 1e-4}
# Kept float32 whatever the model dtype, as in released checkpoints and in HF's loader.
FP32_SUFFIXES = ("gate.weight", "gate.e_score_correction_bias")
PATTERN_CHARS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


# ---- make ------------------------------------------------------------------------------------------
def fresh_value(name: str, shape: tuple[int, ...], hidden: int) -> torch.Tensor:
    """A new float32 random value for the parameter/buffer `name` (in-memory HF name, e.g.
    model.layers.3.mixer.A_log) of `shape`. Chosen so nothing is zero, one or tied, and so the
    activations keep roughly unit RMS through the layers. Unknown names raise: every tensor must
    be re-randomised on purpose."""
    randn = torch.randn(shape)
    if name.endswith("embeddings.weight"):
        return randn
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return 1.0 + 0.1 * randn
    if name.endswith(".A_log"):  # A = -exp(A_log) in [-16, -1]
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0))
    if name.endswith(".D"):
        return torch.empty(shape).uniform_(0.5, 1.5)
    if name.endswith(".dt_bias"):  # softplus(dt_bias) log-uniform in [1e-3, 0.1]
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(0.1)))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("conv1d.weight"):  # [conv_dim, 1, K]
        return randn / math.sqrt(shape[-1])
    if name.endswith("gate.weight"):  # router [E, H]: logits of std ~0.5
        return randn * (0.5 / math.sqrt(hidden))
    if name.endswith("gate.e_score_correction_bias"):
        return 0.05 * randn
    if name.endswith("experts.up_proj") or name.endswith("experts.down_proj"):  # [E, out, in]
        return randn / math.sqrt(shape[-1])
    if name == "lm_head.weight":  # logits of std ~2: wide top-1/top-2 margins
        return randn * (2.0 / math.sqrt(shape[1]))
    if name.endswith(".weight") and len(shape) == 2:  # nn.Linear [out, in]
        return randn / math.sqrt(shape[1])
    if name.endswith(".bias"):
        return 0.1 * randn
    raise ValueError(f"no re-randomisation rule for tensor {name} {list(shape)}")


def randomise(model: NemotronHForCausalLM) -> None:
    """Overwrite every parameter and buffer of `model` in place with `fresh_value`."""
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            tensor.copy_(fresh_value(name, tuple(tensor.shape), hidden))


def cast_model(model: NemotronHForCausalLM, dtype: torch.dtype) -> None:
    """Cast to `dtype`, keeping the router weight and correction bias float32 (as HF loads them)."""
    keep = {n: t.detach().clone() for n, t in model.state_dict().items() if n.endswith(FP32_SUFFIXES)}
    model.to(dtype)
    for name, value in keep.items():
        module_name, attr = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[attr] = value
    model.config.dtype = dtype


def write_spelling(out_dir: Path, spelling: str) -> None:
    """Rewrite out_dir/config.json so the layer layout has exactly one spelling: "list"
    (layers_block_type, as transformers 5 writes) or "pattern" (hybrid_override_pattern plus
    num_hidden_layers, as the released NVIDIA configs do)."""
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    kinds = cfg.pop("layers_block_type", None) or [
        {v: k for k, v in PATTERN_CHARS.items()}[c] for c in cfg["hybrid_override_pattern"]
    ]
    cfg.pop("hybrid_override_pattern", None)
    cfg.pop("num_hidden_layers", None)
    if spelling == "list":
        cfg["layers_block_type"] = kinds
    elif spelling == "pattern":
        cfg["hybrid_override_pattern"] = "".join(PATTERN_CHARS[k] for k in kinds)
        cfg["num_hidden_layers"] = len(kinds)
    else:
        raise ValueError(f"layout_spelling must be 'list' or 'pattern', got {spelling!r}")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make(job: dict) -> dict:
    """Build, re-randomise, cast and save one checkpoint with save_pretrained (safetensors)."""
    raw = {**TINY_DT_DEFAULTS, **job["config"]}
    torch.manual_seed(int(job.get("seed", 0)))
    model = NemotronHForCausalLM(NemotronHConfig(**raw))
    randomise(model)
    cast_model(model, DTYPES[job.get("dtype", "float32")])
    out_dir = Path(job["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_spelling(out_dir, job.get("layout_spelling", "list"))
    return {"out_dir": str(out_dir)}


# ---- forward jobs ----------------------------------------------------------------------------------
class DtWatch:
    """Records the smallest softplus(dt + dt_bias) any Mamba layer of a model computes, via a
    forward hook on each in_proj (whose last nh output columns are the raw dt)."""

    def __init__(self, model: NemotronHForCausalLM):
        self.floor = float(model.config.time_step_min)
        self.min_dt = math.inf
        for module in model.modules():
            if hasattr(module, "dt_bias") and hasattr(module, "in_proj"):
                module.in_proj.register_forward_hook(self._hook(module.dt_bias))

    def _hook(self, dt_bias: torch.Tensor):
        def hook(_module, _inputs, output):
            dt = F.softplus(output[..., -dt_bias.shape[0]:].float() + dt_bias.float())
            self.min_dt = min(self.min_dt, float(dt.min()))
        return hook

    def check(self, model_dir: str) -> float:
        """Raise if HF's time_step_min clamp can have fired; return the smallest dt seen."""
        if self.min_dt <= self.floor:
            raise RuntimeError(
                f"{model_dir}: a Mamba dt of {self.min_dt:.3g} reached time_step_min={self.floor:g}; "
                "transformers' full-sequence path clamps there (its decode path and nemoh do not), so "
                "these oracle results would not be the model's defined semantics. Use a checkpoint "
                "with a tiny time_step_min (e.g. 1e-7)."
            )
        return self.min_dt


_LOADED: dict[tuple[str, str], tuple[NemotronHForCausalLM, DtWatch]] = {}


def load(model_dir: str, dtype: str) -> tuple[NemotronHForCausalLM, DtWatch]:
    """from_pretrained with the eager (reference) attention and expert code; cached per process."""
    key = (model_dir, dtype)
    if key not in _LOADED:
        kwargs = dict(dtype=DTYPES[dtype], local_files_only=True, attn_implementation="eager")
        try:
            model = NemotronHForCausalLM.from_pretrained(model_dir, experts_implementation="eager", **kwargs)
        except TypeError:  # transformers releases before the experts_implementation switch (e.g. the GPU image's)
            model = NemotronHForCausalLM.from_pretrained(model_dir, **kwargs)
        model.eval()
        _LOADED[key] = (model, DtWatch(model))
    model, watch = _LOADED[key]
    watch.min_dt = math.inf
    return model, watch


def forward_logits(model: NemotronHForCausalLM, ids: list[int]) -> torch.Tensor:
    """Full-sequence forward of one unpadded sequence, no cache: float32 logits [len, V]."""
    if not ids:
        raise ValueError("empty prompt")
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()


def logits(job: dict, j: int, arrays: dict[str, np.ndarray]) -> dict:
    """Store each prompt's logits [len, V] float32 in `arrays` under j{j}_p{p}."""
    model, watch = load(job["model_dir"], job.get("dtype", "float32"))
    names = []
    for p, prompt in enumerate(job["prompts"]):
        names.append(f"j{j}_p{p}")
        arrays[names[-1]] = forward_logits(model, [int(t) for t in prompt]).numpy()
    return {"arrays": names, "min_dt": watch.check(job["model_dir"])}


def greedy_one(model: NemotronHForCausalLM, prompt: list[int], max_new: int, stops: set[int]) -> dict:
    """Greedy decode by repeated full forward (no cache). margins[i] = top-1 minus top-2 logit at
    the step that chose tokens[i]; a stop token ends the output and is included."""
    ids, tokens, margins = list(prompt), [], []
    for _ in range(max_new):
        last = forward_logits(model, ids)[-1]
        top2 = torch.topk(last, 2).values
        token = int(torch.argmax(last))
        tokens.append(token)
        margins.append(float(top2[0] - top2[1]))
        ids.append(token)
        if token in stops:
            break
    return {"tokens": tokens, "margins": margins}


def greedy(job: dict) -> dict:
    model, watch = load(job["model_dir"], job.get("dtype", "float32"))
    stops = {int(t) for t in job.get("stop_token_ids", [])}
    results = [greedy_one(model, [int(t) for t in p], int(job["max_new_tokens"]), stops) for p in job["prompts"]]
    return {"results": results, "min_dt": watch.check(job["model_dir"])}


# ---- tokenizer and chat template -------------------------------------------------------------------
def text(job: dict) -> dict:
    """transformers' reading of a checkpoint's tokenizer files: encode each text (default special tokens),
    and render + tokenize each chat with apply_chat_template."""
    tok = AutoTokenizer.from_pretrained(job["model_dir"], local_files_only=True)
    chats = []
    for chat in job.get("chats", []):
        kwargs = dict(add_generation_prompt=chat["add_generation_prompt"], tools=chat.get("tools"))
        rendered = tok.apply_chat_template(chat["messages"], tokenize=False, **kwargs)
        ids = tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=False, **kwargs)
        chats.append({"text": rendered, "ids": [int(t) for t in ids]})
    return {"encoded": [tok(t)["input_ids"] for t in job.get("texts", [])], "chats": chats}


# ---- entry point -----------------------------------------------------------------------------------
def run(request: dict) -> None:
    """Run every job in order; write result.json and arrays.npz to request["output_dir"]."""
    arrays: dict[str, np.ndarray] = {}
    results = []
    for j, job in enumerate(request["jobs"]):
        kind = job.get("kind")
        if kind == "make":
            results.append(make(job))
        elif kind == "logits":
            results.append(logits(job, j, arrays))
        elif kind == "greedy":
            results.append(greedy(job))
        elif kind == "text":
            results.append(text(job))
        else:
            raise ValueError(f"job {j}: unknown kind {kind!r} (make | logits | greedy | text)")
    out = Path(request["output_dir"])
    np.savez(out / "arrays.npz", **arrays)
    (out / "result.json").write_text(json.dumps({"jobs": results}))


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(f"usage: {argv[0]} REQUEST.json")
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    run(json.loads(Path(argv[1]).read_text()))


if __name__ == "__main__":
    main(sys.argv)
