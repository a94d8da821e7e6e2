"""The nemoh CLI: streaming text generation and its report, `info` on every tiny checkpoint, bad flags,
nemoh errors as one line on stderr, and --help documenting every option with its default."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import nemoh
import nemoh.text.generate as text_generate
from nemoh.cli import _Formatter, build_parser, main
from nemoh.cli.info import module_group, summarise
from nemoh.cli.timing import GenerationClock
from nemoh.io.quantize import quantize_checkpoint
from nemoh.io.tensor_source import TensorSource

from conftest import ROOT

TINY = ROOT / "checkpoints" / "tiny-nemotron-h"


class Recorder:
    """A stdout stand-in that logs each write next to the events the test adds."""

    def __init__(self, events):
        self.events = events

    def write(self, s):
        self.events.append(("write", s))

    def flush(self):
        pass

    def text(self):
        return "".join(s for kind, s in self.events if kind == "write")


def run_cli(argv, capsys):
    """main(argv) in this process -> (exit status, stdout, stderr); argparse errors give status 2."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---- generate --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(demo_checkpoint):
    return nemoh.load(demo_checkpoint, dtype=jax.numpy.bfloat16), nemoh.load_tokenizer(demo_checkpoint)


def test_generate_streams_text_and_reports(demo_checkpoint, demo, capsys, monkeypatch):
    events = []
    real = text_generate.generate

    def watched(*args, **kwargs):
        events.append(("generate called", None))
        out = real(*args, **kwargs)
        events.append(("generate returned", None))
        return out

    monkeypatch.setattr(text_generate, "generate", watched)
    out = Recorder(events)
    monkeypatch.setattr(sys, "stdout", out)
    prompt = "Once upon a time"
    rc, _, err = run_cli(["generate", "--model", demo_checkpoint, "--prompt", prompt, "--max-new-tokens", 40], capsys)
    assert rc == 0, err
    kinds = [k for k, _ in events]
    called, returned = kinds.index("generate called"), kinds.index("generate returned")
    assert "write" in kinds[called:returned], "no text was written while generating"
    params, tok = demo
    expected = nemoh.generate_text(params, tok, [prompt], max_new_tokens=40)[0]
    assert out.text() == prompt + expected + "\n"
    lines = err.splitlines()
    assert lines[0].startswith(f"model {demo_checkpoint}: 8 layers ME*M-M*E, 1.67M params, dtype bfloat16, "
                               "quantisation none, device cpu"), lines[0]
    assert lines[1].startswith("prefill: first tokens after") and "(compile " in lines[1]
    assert lines[2].startswith("decode: 39 tokens in") and "steady state" in lines[2] and "tokens/s" in lines[2]
    assert lines[3].startswith("total: 40 new tokens in") and "of it compiling" in lines[3]


def test_clock_counts_compiling_that_overlaps_decode_once():
    """The decode program compiles beside prefill: only the part of it after the first token slows
    decode, and overlapping compiles count once in the total."""
    clock = GenerationClock(start=0.0, first_token=10.0, end=20.0, tokens=11, compile_prefill=8.0,
                            compile_decode=12.0, compiling=[(0.0, 8.0), (2.0, 14.0), (12.0, 13.0)])
    prefill, decode, total = clock.report(batch=1)
    assert decode == "decode: 10 tokens in 10.00 s (compile 12.00 s); steady state 1.7 tokens/s"  # 10 / (10 - 4)
    assert total == "total: 11 new tokens in 20.00 s, 14.00 s of it compiling"


def test_generate_batch_and_chat(demo_checkpoint, demo, capsys):
    params, tok = demo
    prompts = ["Alice", "The Queen said"]
    rc, out, err = run_cli(["generate", "--model", demo_checkpoint, "--prompt", prompts[0], "--prompt", prompts[1],
                            "--max-new-tokens", 24], capsys)
    assert rc == 0, err
    expected = nemoh.generate_text(params, tok, prompts, max_new_tokens=24)
    assert out == "".join(f"[{i}] {p}{t}\n" for i, (p, t) in enumerate(zip(prompts, expected)))
    live = err.split("\n", 1)[1].rsplit("\nprefill: ", 1)[0]  # between the load line and the report
    streamed = collections.defaultdict(str)
    for chunk in ("\n" + live.rstrip("\n")).split("\n[")[1:]:
        label, text = chunk.split("] ", 1)
        streamed[int(label)] += text
    assert [streamed[0], streamed[1]] == expected
    rc, out, err = run_cli(["generate", "--model", demo_checkpoint, "--prompt", "Who are you?", "--chat",
                            "--max-new-tokens", 40], capsys)  # 40: the compiled shapes of the streaming test
    assert rc == 0, err
    assert out == nemoh.generate_text(params, tok, ["Who are you?"], chat=True, max_new_tokens=40)[0] + "\n"


def test_generate_ids(demo_checkpoint, demo, capsys):
    rc, out, err = run_cli(["generate", "--model", demo_checkpoint, "--prompt-ids", "1 5 9 200",
                            "--max-new-tokens", 40, "--ignore-eos"], capsys)
    assert rc == 0, err
    expected = nemoh.generate(demo[0], [[1, 5, 9, 200]], max_new_tokens=40, ignore_eos=True)[0]
    assert out == "1 5 9 200 -> " + "".join(f"{t} " for t in expected) + "\n"


# ---- errors and flags ------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--prompt", "Once"], r"tiny-nemotron-h/tokenizer.json not found"),
    (["--prompt-ids", "1 x"], r"--prompt-ids '1 x' \(prompt 0\): must be space-separated integers"),
    (["--prompt-ids", "1", "--chat"], r"--chat needs text prompts"),
    (["--prompt-ids", "1 999"], r"token id 999 at index \[1\] is outside the vocabulary \[0, 256\)"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], r"max_new_tokens=0: must be an integer in \[1, "),
    (["--prompt-ids", "1", "--temperature", "-1"], r"temperature=-1.0: must be a finite number >= 0"),
    (["--prompt-ids", "1", "--top-p", "2"], r"top_p=2.0: must be a finite number in \(0.0, 1.0\]"),
])
def test_nemoh_errors_are_one_line(args, message, capsys):
    rc, out, err = run_cli(["generate", "--model", TINY, *args], capsys)
    *before, last = err.splitlines()
    assert rc == 1 and out == "" and "Traceback" not in err
    assert last.startswith("nemoh: error: ") and re.search(message, last), err
    assert all(line.startswith(f"model {TINY}: ") for line in before), err  # the load report, when it got that far


def test_empty_text_prompt_fails_before_loading(demo_checkpoint, capsys):
    rc, out, err = run_cli(["generate", "--model", demo_checkpoint, "--prompt", ""], capsys)
    assert rc == 1 and err == "nemoh: error: prompt 0 ('') encodes to no tokens\n", err


def test_missing_checkpoint_is_one_line(tmp_path, capsys):
    for argv in (["generate", "--model", tmp_path / "nope", "--prompt-ids", "1"], ["info", tmp_path / "nope"]):
        rc, out, err = run_cli(argv, capsys)
        assert rc == 1 and err == f"nemoh: error: checkpoint directory {tmp_path / 'nope'} does not exist\n", err


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1", "--max-new-tokens", "ten"], "argument --max-new-tokens: invalid int value: 'ten'"),
    (["--prompt", "a", "--prompt-ids", "1"], "argument --prompt-ids: not allowed with argument --prompt"),
    ([], "one of the arguments --prompt --prompt-ids is required"),
    (["--prompt-ids", "1", "--bogus"], "unrecognized arguments: --bogus"),
    (["--prompt-ids", "1", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
])
def test_bad_flags_exit_2_with_usage(args, message, capsys):
    rc, out, err = run_cli(["generate", "--model", TINY, *args], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("usage: nemoh") and message in err, err


def test_entry_point_prints_no_traceback():
    for argv, status in ((["generate", "--model", str(TINY), "--prompt", "hi"], 1), (["info"], 2)):
        proc = subprocess.run([sys.executable, "-m", "nemoh", *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == status and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "nemoh info: error: the following arguments are required: DIR"


def test_help_documents_every_option_with_default():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "generate" in a.choices).choices
    for name, sub in subparsers.items():
        help_text = " ".join(sub.format_help().split())
        formatter = _Formatter(sub.prog)
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            line = formatter._get_help_string(action)
            assert action.required or "(default: " in line, (name, action.dest, line)
            assert " ".join((line % vars(action) if "%(default)" in line else line).split()) in help_text


# ---- info ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantised_tiny(tmp_path_factory):
    """NVFP4 and MIXED copies of the shipped tiny checkpoint, with the quantiser's plans."""
    root = tmp_path_factory.mktemp("quantised")
    return {algo: (root / algo, quantize_checkpoint(TINY, root / algo, algo)) for algo in ("NVFP4", "MIXED")}


def _param_count(path) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nemoh.load(path, dtype=jax.numpy.float32)))


def test_info_on_every_tiny_checkpoint(tiny_checkpoints, demo_checkpoint, quantised_tiny, capsys, monkeypatch):
    dense = {**tiny_checkpoints, "shipped": TINY, "demo": demo_checkpoint}
    counts = {name: _param_count(path) for name, path in dense.items()}
    monkeypatch.setattr(TensorSource, "get", lambda *a, **k: pytest.fail("info read tensor data"))
    for name, path in {**dense, **{algo: p for algo, (p, _) in quantised_tiny.items()}}.items():
        rc, out, err = run_cli(["info", path], capsys)
        assert rc == 0, err
        cfg = nemoh.NemotronHConfig.from_json_file(path / "config.json")
        assert f"layers        {cfg.num_layers}: {cfg.pattern}" in out
        total = summarise(path).total
        assert f"{'total':<13} {total.tensors:>8} {total.params:>14,} {total.bytes:>14,}" in out
        assert total.params == counts.get(name, counts["shipped"]), name
        assert total.bytes == sum(f.stat().st_size for f in path.glob("*.safetensors")) - sum(
            8 + int.from_bytes(f.read_bytes()[:8], "little") for f in path.glob("*.safetensors"))
    for algo, (path, plan) in quantised_tiny.items():
        cfg = nemoh.NemotronHConfig.from_json_file(path / "config.json")
        expected = collections.defaultdict(collections.Counter)
        for module, fmt in plan.items():
            expected[module_group(module, cfg)][fmt or "BF16"] += 1
        assert summarise(path).groups == {g: dict(c) for g, c in expected.items()}
        stored = json.loads((path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
        assert stored in ("MIXED_PRECISION" if algo == "MIXED" else algo, f"W4A16_{algo}")  # uncalibrated NVFP4
        assert f"quantisation  {stored} (from hf_quant_config.json)" in run_cli(["info", path], capsys)[1]
    assert "tokenizer     tokenizer.json, vocab 2048, with a chat template" in run_cli(["info", demo_checkpoint], capsys)[1]
