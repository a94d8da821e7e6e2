"""Tests of the oracle plumbing (nemoh.oracle + hf_worker) and of the shipped tiny checkpoint.

Worker calls cost ~10 s each (importing torch + transformers), so the forward-path tests share
one greedy call and two logits calls through the module fixture `runs`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import nemoh.oracle as oracle
from nemoh.config import NemotronHConfig
from nemoh.io.layout import hf_layout
from nemoh.io.tensor_source import TensorSource
from oracle_configs import CONFIGS, layout_spelling

REPO = Path(__file__).resolve().parents[1]
TINY_DIR = REPO / "checkpoints" / "tiny-nemotron-h"
_WORDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# Prompt lengths around chunk_size 8/16: shorter, not a multiple, exactly two chunks.
PROMPTS = [[(7 * i + 11) % 120 + 3 for i in range(21)], [9, 4, 30], [(5 * i + 1) % 100 + 3 for i in range(16)]]


def kinds_of(cfg: dict) -> list[str]:
    """transformers' layer words of a config in either spelling."""
    if "hybrid_override_pattern" in cfg:
        return [_WORDS[c] for c in cfg["hybrid_override_pattern"]]
    return list(cfg["layers_block_type"])


def check_hf_layout(directory: Path, cfg: dict, dtype: str) -> None:
    """Saved names and shapes are exactly nemoh's HF layout table (nemoh.io.layout, read off the loader);
    router tensors F32, the rest `dtype`."""
    src = TensorSource(directory)
    expected = {s.name + ".weight" if s.projection else s.name: s.shape
                for s in hf_layout(NemotronHConfig.from_dict(cfg))}
    assert src.names() == set(expected), sorted(src.names() ^ set(expected))
    for name, shape in expected.items():
        assert src.shape_of(name) == shape, name
        router = name.endswith(("gate.weight", "gate.e_score_correction_bias"))
        assert src.dtype_of(name) == ("F32" if router else dtype), name


# ---- make -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_saved_keys_are_hf_layout(tiny_checkpoints, name):
    check_hf_layout(tiny_checkpoints[name], CONFIGS[name], "F32")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layout_spelling_as_asked(tiny_checkpoints, name):
    saved = json.loads((tiny_checkpoints[name] / "config.json").read_text())
    if layout_spelling(CONFIGS[name]) == "pattern":
        assert "layers_block_type" not in saved
        assert saved["num_hidden_layers"] == len(saved["hybrid_override_pattern"])
    else:
        assert "hybrid_override_pattern" not in saved and "num_hidden_layers" not in saved
    assert kinds_of(saved) == kinds_of(CONFIGS[name])
    assert saved["time_step_min"] <= 1e-6
    assert saved["eos_token_id"] == CONFIGS[name]["eos_token_id"]


def test_configs_cover_the_required_features():
    cfgs = list(CONFIGS.values())
    assert any(set(kinds_of(c)) == set(_WORDS.values()) for c in cfgs)
    assert {layout_spelling(c) for c in cfgs} == {"list", "pattern"}
    moe = [c for c in cfgs if "moe" in kinds_of(c)]
    assert any(c["n_group"] > 1 and c["topk_group"] < c["n_group"] for c in moe)
    assert any(not c["norm_topk_prob"] for c in moe) and any(c.get("moe_latent_size") for c in moe)
    assert any(c["n_groups"] > 1 for c in cfgs) and {3, 5} <= {c["conv_kernel"] for c in cfgs}
    assert any(1 < c["num_key_value_heads"] < c["num_attention_heads"] for c in cfgs)
    assert all(c["chunk_size"] <= 16 and c.get("eos_token_id") is not None for c in cfgs)
    assert max(map(len, PROMPTS)) > 16 and any(len(p) % c["chunk_size"] for p in PROMPTS for c in cfgs)


# ---- forward jobs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tiny_checkpoints):
    """One greedy call and the same logits call twice, on all_kinds and latent_moe (float32) and
    on the shipped bf16 checkpoint."""
    dirs = [tiny_checkpoints["all_kinds"], tiny_checkpoints["latent_moe"]]
    vocab_all = list(range(CONFIGS["all_kinds"]["vocab_size"]))
    gen = oracle.greedy([{"model_dir": d, "prompts": PROMPTS, "max_new_tokens": 12} for d in dirs]
                        + [{"model_dir": dirs[0], "prompts": PROMPTS[:1], "max_new_tokens": 12, "stop_token_ids": vocab_all}])
    full = [[p + g["tokens"] for p, g in zip(PROMPTS, per_prompt)] for per_prompt in gen[:2]]
    jobs = [{"model_dir": d, "prompts": f} for d, f in zip(dirs, full)]
    jobs.append({"model_dir": TINY_DIR, "prompts": [np.array(p) for p in PROMPTS], "dtype": "bfloat16"})
    return {"greedy": gen, "full": full, "logits": oracle.logits(jobs), "again": oracle.logits(jobs)}


def test_logits_finite_and_deterministic(runs):
    vocabs = [CONFIGS["all_kinds"]["vocab_size"], CONFIGS["latent_moe"]["vocab_size"], 256]
    seqs = runs["full"] + [PROMPTS]
    for job, again, seq, vocab in zip(runs["logits"], runs["again"], seqs, vocabs):
        for x, y, s in zip(job, again, seq):
            assert x.dtype == np.float32 and x.shape == (len(s), vocab)
            assert np.isfinite(x).all() and x.std() > 0.1
            np.testing.assert_array_equal(x, y)


def test_greedy_agrees_with_logits_argmax(runs):
    checked = 0
    for per_prompt, logits in zip(runs["greedy"][:2], runs["logits"][:2]):
        for prompt, g, x in zip(PROMPTS, per_prompt, logits):
            assert len(g["tokens"]) == len(g["margins"]) == 12
            rows = x[len(prompt) - 1 : -1]
            top2 = np.sort(rows, axis=-1)[:, -2:]
            np.testing.assert_allclose(g["margins"], top2[:, 1] - top2[:, 0], atol=1e-4)
            sure = np.asarray(g["margins"]) > 1e-4
            np.testing.assert_array_equal(np.asarray(g["tokens"])[sure], rows.argmax(-1)[sure])
            checked += int(sure.sum())
    assert checked >= 60


def test_greedy_stops_after_stop_token(runs):
    (stopped,) = runs["greedy"][2]
    assert stopped["tokens"] == runs["greedy"][0][0]["tokens"][:1]


def test_dt_clamp_is_detected(tiny_checkpoints, tmp_path):
    """A checkpoint whose time_step_min HF's full-sequence path would clamp at is refused."""
    ckpt = shutil.copytree(tiny_checkpoints["all_kinds"], tmp_path / "clamped")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["time_step_min"] = 0.5
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(oracle.OracleFailed, match="time_step_min=0.5"):
        oracle.logits([{"model_dir": ckpt, "prompts": PROMPTS[:1]}])


# ---- client ---------------------------------------------------------------------------------------
def test_unavailable_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(oracle.ENV_VAR, str(tmp_path / "no-such-python"))
    with pytest.raises(oracle.OracleUnavailable, match="scripts/setup_oracle.sh"):
        oracle.oracle_python()
    with pytest.raises(oracle.OracleUnavailable, match="no-such-python"):
        oracle.logits([{"model_dir": tmp_path, "prompts": [[1]]}])
    monkeypatch.delenv(oracle.ENV_VAR)
    monkeypatch.setattr(oracle, "REPO_ROOT", tmp_path)
    with pytest.raises(oracle.OracleUnavailable, match=r"\.venv-oracle"):
        oracle.oracle_python()


def _imported_roots(path: Path) -> set[str]:
    """Top-level package names a source file imports."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_import_boundaries():
    """The worker never imports nemoh/jax; the client never imports torch/transformers."""
    assert not _imported_roots(oracle.WORKER) & {"nemoh", "jax", "jaxlib"}
    assert not _imported_roots(Path(oracle.__file__)) & {"torch", "transformers", "jax", "safetensors"}


# ---- shipped checkpoint ---------------------------------------------------------------------------
def test_shipped_tiny_checkpoint_matches_make_tiny():
    spec = importlib.util.spec_from_file_location("make_tiny", REPO / "checkpoints" / "make_tiny.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    saved = json.loads((TINY_DIR / "config.json").read_text())
    assert {k: saved[k] for k in make_tiny.CONFIG} == make_tiny.CONFIG
    assert set(saved["hybrid_override_pattern"]) == set("M*-E") and "layers_block_type" not in saved
    check_hf_layout(TINY_DIR, make_tiny.CONFIG, "BF16")
    assert sum(p.stat().st_size for p in TINY_DIR.iterdir()) < 2 * 1024 * 1024
