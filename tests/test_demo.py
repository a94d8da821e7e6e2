"""The trained demo checkpoint: STRICT token gate against transformers, readable English from a text
prompt, a tokenizer reproducible from the committed corpus, and the training script lowering the loss."""

from __future__ import annotations

import collections
import importlib.util
import re

import jax.numpy as jnp
import pytest

import nemoh
from nemoh.gate import default_prompts, run_gate

from conftest import ROOT


@pytest.fixture(scope="module")
def make_demo():
    """checkpoints/make_demo.py as a module."""
    spec = importlib.util.spec_from_file_location("make_demo", ROOT / "checkpoints" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_passes_the_gate(demo_checkpoint):
    cfg = nemoh.NemotronHConfig.from_json_file(demo_checkpoint / "config.json")
    assert set(cfg.layer_kinds) == {"mamba", "attention", "mlp", "moe"}
    result = run_gate(demo_checkpoint, default_prompts(cfg, [3, 40, 90]), max_new_tokens=24, dtype="float32")
    print(result.line())
    assert result.strict, result.line()
    assert result.total >= 24 * 3 // 2, f"the oracle stopped early: {result.line()}"


def test_demo_writes_readable_english(demo_checkpoint, make_demo):
    params = nemoh.load(demo_checkpoint, dtype=jnp.bfloat16)
    text = nemoh.generate_text(params, nemoh.load_tokenizer(demo_checkpoint), ["Once upon a time"],
                               max_new_tokens=40)[0]
    print(repr(text))
    corpus_words = set(re.findall(r"[a-z]+", make_demo.CORPUS.read_text().lower()))
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 15, text
    assert sum(w in corpus_words for w in words) / len(words) >= 0.95, text
    trigrams = collections.Counter(zip(words, words[1:], words[2:]))
    assert max(trigrams.values()) <= 2, text  # not a loop ("and the Hatter, and the Hatter, ...")


def test_tokenizer_is_reproducible_from_the_corpus(demo_checkpoint, make_demo):
    text = make_demo.prepare_text(make_demo.CORPUS.read_text(encoding="utf-8"))
    fresh = make_demo.train_tokenizer(text, make_demo.CONFIG["vocab_size"])
    shipped = nemoh.load_tokenizer(demo_checkpoint).backend
    assert fresh.to_str() == shipped.to_str()


def test_training_script_lowers_the_loss(make_demo, tmp_path):
    out = tmp_path / "demo"
    curve = make_demo.main(["--steps", "12", "--corpus-chars", "20000", "--batch", "4", "--seq-len", "64",
                            "--log-every", "4", "--out", str(out)])
    print(curve)
    assert [c["step"] for c in curve] == [4, 8, 12]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"] - 0.5
    assert curve[-1]["val_loss"] < curve[0]["val_loss"]
    params = nemoh.load(out, dtype=jnp.float32)
    tok = nemoh.load_tokenizer(out)
    assert tok.vocab_size == params.config.vocab_size
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == params.config.bos_token_id
