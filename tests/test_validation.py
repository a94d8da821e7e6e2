"""Every bad argument gets a named error (NemohError subclass naming argument and value) before any
device work; bad dtypes and non-finite weights are refused at load; NaN/Inf logits raise NonFiniteError;
a request too big for memory raises CacheCapacityError; the gate CLI prints errors in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import nemoh
from nemoh import CacheSpec, CheckpointError, NonFiniteError, RequestError
from nemoh.engine.decode import decode
from nemoh.engine.prefill import prefill
from nemoh.gate import run_gate

ROOT = Path(__file__).parents[1]
SHIPPED = ROOT / "checkpoints" / "tiny-nemotron-h"
NEW = dict(max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    return nemoh.load(SHIPPED, dtype=jnp.float32)


@pytest.mark.parametrize("kwargs, match", [
    ({"stop_token_ids": "210"}, r"stop_token_ids='210': must be None or a list of token ids"),
    ({"stop_token_ids": 5}, r"stop_token_ids=5: must be None or a list"),
    ({"stop_token_ids": [1.5]}, r"stop_token_ids\[0\]=1.5: must be an integer token id"),
    ({"stop_token_ids": [True]}, r"stop_token_ids\[0\]=True"),
    ({"temperature": "1"}, r"temperature='1': must be a finite number >= 0"),
    ({"temperature": True}, r"temperature=True"),
    ({"temperature": float("inf")}, r"temperature=inf"),
    ({"temperature": float("nan")}, r"temperature=nan"),
    ({"temperature": 1e39}, r"temperature=1e\+39"),
    ({"temperature": None}, r"temperature=None"),
    ({"temperature": [0.5]}, r"temperature=\[0.5\]: must be one value for every prompt, or a list of 2"),
    ({"temperature": [0.5, [1, 2]]}, r"temperature\[1\]=\[1, 2\]: must be a finite number"),
    ({"top_p": np.ones((2, 1))}, r"(?s)top_p=array.*: must be one value for every prompt, or a list of one value"),
    ({"top_k": True}, r"top_k=True: must be an integer >= 1"),
    ({"top_k": 2.0}, r"top_k=2.0"),
    ({"top_p": float("nan")}, r"top_p=nan: must be a finite number in \(0.0, 1.0\]"),
    ({"max_new_tokens": True}, r"max_new_tokens=True: must be an integer"),
    ({"max_new_tokens": 2.0}, r"max_new_tokens=2.0"),
    ({"max_new_tokens": 2**31}, r"max_new_tokens=2147483648: must be an integer in \[1, "),
    ({"seed": "x"}, r"seed='x': must be an integer"),
    ({"seed": 1.5}, r"seed=1.5"),
    ({"seed": None}, r"seed=None"),
    ({"seed": True}, r"seed=True"),
    ({"seed": [1, 2, 3]}, r"seed=\[1, 2, 3\]: must be one value for every prompt, or a list of 2"),
    ({"prefill_chunk": 0}, r"prefill_chunk=0: must be an integer in \[1, "),
    ({"prefill_chunk": -4}, r"prefill_chunk=-4"),
    ({"prefill_chunk": 16.0}, r"prefill_chunk=16.0"),
    ({"prefill_chunk": "wide"}, r"prefill_chunk='wide'"),
    ({"steps_per_call": 0}, r"steps_per_call=0"),
    ({"ignore_eos": 1}, r"ignore_eos=1: must be True or False"),
    ({"on_token": "print"}, r"on_token='print': must be None or a callable"),
    ({"cache": None}, r"cache=None: must be a CacheSpec"),
])
def test_generate_arguments_are_named(params, kwargs, match):
    with pytest.raises(RequestError, match=match):
        nemoh.generate(params, [[1, 2], [3]], **{**NEW, **kwargs})


@pytest.mark.parametrize("prompts, match", [
    (np.zeros((0, 4), np.int32), r"prompt_ids is empty \(shape \[0, 4\]\)"),
    (np.zeros((2, 0), np.int32), r"prompt_ids is empty \(shape \[2, 0\]\)"),
    ([[1, True]], "prompt 0 holds non-integer entries"),
    ([1.0, 2.0], "prompt_ids=.*holds non-integer entries"),
    ([[1, 2], 3], "prompt_ids=.*holds non-integer entries"),
    ("1 2 3", "prompt_ids must be|prompt_ids='1 2 3'"),
    (None, "prompt_ids=None"),
    (np.array([[0.5, 1.0]]), "prompt 0: token ids must be integers, got dtype float64"),
    ([[2**70]], r"prompt 0: token id 1180591620717411303424 at index \[0\] is outside the vocabulary"),
])
def test_bad_prompts_are_named(params, prompts, match):
    with pytest.raises(RequestError, match=match):
        nemoh.generate(params, prompts, **NEW)


def test_numpy_integers_are_integers(params):
    out = nemoh.generate(params, np.array([[5, 6, 7]], np.int64), max_new_tokens=np.int64(3), ignore_eos=True,
                         top_k=np.int32(4), temperature=np.float32(0.5), seed=np.uint64(7))
    assert len(out[0]) == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"page_size": True}, r"page_size=True: must be an integer in \[1, "),
    ({"page_size": 0}, r"page_size=0"),
    ({"page_size": 4.0}, r"page_size=4.0"),
    ({"num_pages": 0}, r"num_pages=0"),
    ({"num_pages": "8"}, r"num_pages='8'"),
    ({"memory_budget_bytes": 1e7}, r"memory_budget_bytes=10000000.0: must be an integer >= 1"),
    ({"memory_budget_bytes": "x"}, r"memory_budget_bytes='x'"),
    ({"num_pages": 4, "memory_budget_bytes": 1 << 20}, "not both"),
])
def test_cachespec_arguments_are_named(kwargs, match):
    with pytest.raises(RequestError, match=match):
        CacheSpec(**kwargs)


@pytest.mark.parametrize("tokens, match", [
    ([[1, 2, 3], [4, 5]], r"tokens: rows of different lengths \[2, 3\]"),
    ([[1, 2], [3, "a"]], "tokens: row 1 holds a non-integer entry 'a'"),
    ([1, True], r"tokens=\[1, True\]: must be a list of integer token ids"),
    ([], r"tokens: token ids are empty"),
    ("abc", "tokens='abc'"),
    (np.ones((1, 1, 2), np.int32), "must be 1-D or 2-D"),
    (np.array([[300]]), r"token id 300 at index \[0, 0\] is outside the vocabulary \[0, 256\)"),
])
def test_forward_arguments_are_named(params, tokens, match):
    with pytest.raises(RequestError, match=match):
        nemoh.forward(params, tokens)


def test_forward_and_generate_refuse_non_params():
    with pytest.raises(RequestError, match="params=.*must be ModelParams"):
        nemoh.forward({"embed": 1}, [1, 2])
    with pytest.raises(RequestError, match="params=None: must be ModelParams"):
        nemoh.generate(None, [[1]], max_new_tokens=2)


@pytest.mark.parametrize("dtype", [jnp.int32, bool, "banana", jnp.float8_e4m3fn, 5])
def test_load_refuses_non_float_dtypes(dtype):
    allowed = r"must be a floating dtype, one of \['float32', 'bfloat16', 'float16'\]"
    with pytest.raises(RequestError, match=f"dtype=.*: {allowed}"):
        nemoh.load(SHIPPED, dtype=dtype)


def test_load_dtype_none_is_the_checkpoint_default():
    assert nemoh.load(SHIPPED, dtype=None).dtype == jnp.bfloat16


def test_load_refuses_bad_path_and_progress():
    with pytest.raises(RequestError, match="path=3: must be a path"):
        nemoh.load(3)
    with pytest.raises(RequestError, match="progress='yes'"):
        nemoh.load(SHIPPED, progress="yes")


@pytest.mark.parametrize("name, value", [("backbone.layers.2.mixer.experts.3.up_proj.weight", np.nan),
                                         ("backbone.layers.0.mixer.A_log", np.inf),
                                         ("backbone.norm_f.weight", -np.inf)])
def test_nonfinite_weight_is_named_at_load(tmp_path, name, value):
    ck = tmp_path / "ck"
    shutil.copytree(SHIPPED, ck)
    tensors = load_file(str(ck / "model.safetensors"))
    bad = tensors[name].copy()
    bad.reshape(-1)[min(5, bad.size - 1)] = value
    tensors[name] = bad
    save_file(tensors, str(ck / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor {name} in model.safetensors: holds NaN or Inf"):
        nemoh.load(ck, dtype=jnp.bfloat16)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_float16_overflow_is_named_at_load(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(SHIPPED, ck)
    tensors = load_file(str(ck / "model.safetensors"))
    name = "backbone.layers.1.mixer.q_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = 1e6  # finite in bf16, inf in float16
    save_file(tensors, str(ck / "model.safetensors"))
    nemoh.load(ck, dtype=jnp.float32)
    with pytest.raises(CheckpointError, match=f"tensor {name} .*as loaded in float16"):
        nemoh.load(ck, dtype=jnp.float16)


def _poison(params, leaf: str):
    """params with its `leaf` field (embed / norm_f / lm_head) turned to NaN."""
    return params.__class__(**{**{f: getattr(params, f) for f in ("config", "embed", "norm_f", "lm_head", "layers")},
                               leaf: jnp.full_like(getattr(params, leaf), jnp.nan)})


def test_nonfinite_logits_raise_after_prefill(params):
    with pytest.raises(NonFiniteError, match=r"prompt\(s\) \[0, 1\] while sampling new token\(s\) \[1, 1\]"):
        nemoh.generate(_poison(params, "norm_f"), [[1, 2], [3]], **NEW)


def test_nonfinite_logits_raise_after_decode(params):
    carry = prefill(params, [[5, 6, 7], [8]], max_new_tokens=6)
    with pytest.raises(NonFiniteError, match=r"prompt\(s\) \[0, 1\] while sampling new token\(s\) \[2, 2\]"):
        decode(_poison(params, "lm_head"), carry, 4)


@pytest.mark.parametrize("num_steps", [0, -3, 2.0, True, None])
def test_decode_num_steps_is_checked(params, num_steps):
    carry = prefill(params, [[5, 6, 7]], max_new_tokens=4)
    with pytest.raises(RequestError, match="num_steps="):
        decode(params, carry, num_steps)
    assert decode(params, carry, 1).num_generated[0] == 2  # the refused call consumed nothing


def test_carry_from_other_params_is_refused(params):
    carry = prefill(params, [[5, 6, 7]], max_new_tokens=4)
    bf16 = nemoh.load(SHIPPED, dtype=jnp.bfloat16)
    decode(bf16, prefill(bf16, [[5, 6, 7]], max_new_tokens=4), 1)  # a matching carry passes, and is remembered
    with pytest.raises(RequestError, match=r"carry does not match params: layer 0 state is MambaState\(float32.*"
                                           r"but these params \(bfloat16\) need MambaState\(bfloat16"):
        decode(bf16, carry, 1)
    with pytest.raises(RequestError, match="carry=.*must be a DecodeCarry"):
        decode(params, {"tokens": 1}, 1)


def test_absurd_request_is_refused_before_work(params):
    with pytest.raises(nemoh.CacheCapacityError,
                       match=r"needs about .* bytes of device memory \(KV pool .*, carry .*, activations .*\), "
                             r"but only .* bytes are free \(.*\)"):
        nemoh.generate(params, [[1, 2, 3]], max_new_tokens=10**8)
    with pytest.raises(nemoh.CacheCapacityError, match="bytes are free"):
        nemoh.generate(params, [[1, 2, 3]], max_new_tokens=3, cache=CacheSpec(memory_budget_bytes=10**15))


def test_gate_arguments_and_cli_errors(tmp_path):
    with pytest.raises(RequestError, match=r"dtype='float64': must be one of \['float32', 'bfloat16'\]"):
        run_gate(SHIPPED, [[1, 2]], 3, dtype="float64")
    with pytest.raises(RequestError, match="max_new_tokens=0"):
        run_gate(SHIPPED, [[1, 2]], 0)
    with pytest.raises(RequestError, match="prompt 0: token id 999"):
        run_gate(SHIPPED, [[1, 999]], 3)
    for args, match in [(["--model", str(tmp_path / "nowhere")], "nowhere/config.json: no such file"),
                        (["--model", str(SHIPPED), "--prompt-lengths", "3,x"], "--prompt-lengths='3,x'")]:
        out = subprocess.run([sys.executable, "-m", "nemoh.gate", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and match in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_free_device_memory_names_the_allocator_limit():
    """On a GPU the free figure is the allocator's limit less what is in use, and the refusal says how
    to raise the limit (a bf16 Nano fills an 80 GB card's default .75)."""
    from nemoh.engine.memory import free_bytes

    class Card:
        def memory_stats(self):
            return {"bytes_limit": 64 * 10**9, "bytes_in_use": 63 * 10**9}

        def __str__(self):
            return "cuda:0"

    free, source = free_bytes(Card())
    assert free == 10**9
    assert source == ("cuda:0 memory_stats: 6.3e+10 of the allocator's 6.4e+10 bytes in use; "
                      "XLA_PYTHON_CLIENT_MEM_FRACTION sets that limit, .75 of the card by default")
