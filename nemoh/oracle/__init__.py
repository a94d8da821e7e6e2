"""nemoh.oracle: HF transformers' NemotronHForCausalLM as a correctness oracle, run out of process.

transformers needs torch and Python 3.11, so it lives in its own environment (.venv-oracle, made by
scripts/setup_oracle.sh) and is driven here through hf_worker.py as a subprocess: one subprocess
per call, a JSON request in a temp dir, results read back as JSON + npz. This module imports only
the standard library and numpy, so nemoh never depends on torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("hf_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_VAR = "NEMOH_ORACLE_PYTHON"
TIMEOUT_S = 20 * 60
_STDERR_TAIL = 4000


class OracleUnavailable(RuntimeError):
    """The oracle interpreter (Python 3.11 + torch + transformers) is not installed."""


class OracleFailed(RuntimeError):
    """The worker exited with an error or ran past TIMEOUT_S; the message carries its stderr tail."""


def oracle_python() -> Path:
    """The oracle interpreter: $NEMOH_ORACLE_PYTHON, else <repo>/.venv-oracle/bin/python."""
    configured = os.environ.get(ENV_VAR)
    path = Path(configured) if configured else REPO_ROOT / ".venv-oracle" / "bin" / "python"
    if not path.is_file():
        source = f"${ENV_VAR}" if configured else "the default location"
        raise OracleUnavailable(
            f"oracle interpreter {path} (from {source}) does not exist; run `bash scripts/setup_oracle.sh` "
            f"to create .venv-oracle (or point {ENV_VAR} at a Python with torch and transformers)"
        )
    return path


def _run(jobs: list[dict]) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Run `jobs` in one worker process; return its per-job results and the arrays it wrote."""
    python = oracle_python()
    with tempfile.TemporaryDirectory(prefix="nemoh-oracle-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"output_dir": tmp, "jobs": jobs}, default=str))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        try:
            proc = subprocess.run([str(python), "-I", str(WORKER), str(request)], env=env,
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-_STDERR_TAIL:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            raise OracleFailed(f"oracle worker ran past {TIMEOUT_S} s; stderr tail:\n{tail}") from None
        if proc.returncode != 0:
            raise OracleFailed(
                f"oracle worker {python} {WORKER.name} exited with {proc.returncode}; stderr tail:\n"
                f"{proc.stderr[-_STDERR_TAIL:]}"
            )
        results = json.loads((Path(tmp) / "result.json").read_text())["jobs"]
        with np.load(Path(tmp) / "arrays.npz") as npz:
            arrays = {name: npz[name] for name in npz.files}
    return results, arrays


def _token_lists(prompts) -> list[list[int]]:
    """Prompts (lists or numpy arrays of ids) as plain int lists, for the JSON request."""
    return [[int(t) for t in p] for p in prompts]


def make_checkpoints(specs: list[dict]) -> list[Path]:
    """Make randomly initialised HF checkpoints with transformers' save_pretrained, all in one worker.

    Each spec: config (config.json fields for transformers' NemotronHConfig), out_dir, and optional
    seed (0), dtype ("float32" | "bfloat16"), layout_spelling ("list": layers_block_type |
    "pattern": hybrid_override_pattern), name (a label, unused by the worker). time_step_min
    defaults to 1e-7 (see hf_worker's docstring). Returns the out_dirs."""
    jobs = [{"kind": "make", "config": s["config"], "out_dir": str(s["out_dir"]), "seed": s.get("seed", 0),
             "dtype": s.get("dtype", "float32"), "layout_spelling": s.get("layout_spelling", "list")}
            for s in specs]
    results, _ = _run(jobs)
    return [Path(r["out_dir"]) for r in results]


def logits(jobs: list[dict]) -> list[list[np.ndarray]]:
    """Full-sequence logits, each prompt run alone (no padding, no cache).

    Each job: model_dir, prompts (list of lists of token ids), optional dtype ("float32").
    Returns, per job, per prompt, float32 logits [len(prompt), V]."""
    request = [{"kind": "logits", "model_dir": str(j["model_dir"]), "prompts": _token_lists(j["prompts"]),
                "dtype": j.get("dtype", "float32")} for j in jobs]
    results, arrays = _run(request)
    return [[arrays[name] for name in r["arrays"]] for r in results]


def greedy(jobs: list[dict]) -> list[list[dict]]:
    """Greedy generation by repeated full forward without cache (avoids HF's cache code).

    Each job: model_dir, prompts, max_new_tokens, optional stop_token_ids ([]) and dtype
    ("float32"). Returns, per job, per prompt, {"tokens": [int], "margins": [float]}: the new
    tokens (ending at the first stop token, which is included) and at each step the top-1 minus
    top-2 logit, so callers can tell near-ties (bf16 noise) from real disagreements."""
    request = [{"kind": "greedy", "model_dir": str(j["model_dir"]), "prompts": _token_lists(j["prompts"]),
                "max_new_tokens": int(j["max_new_tokens"]),
                "stop_token_ids": [int(t) for t in j.get("stop_token_ids", [])],
                "dtype": j.get("dtype", "float32")} for j in jobs]
    results, _ = _run(request)
    return [r["results"] for r in results]


def text(jobs: list[dict]) -> list[dict]:
    """transformers' AutoTokenizer on checkpoints' tokenizer files, all in one worker.

    Each job: model_dir, texts, chats ([{messages, add_generation_prompt, optional tools}]). Returns, per
    job, {"encoded": ids per text (default special tokens), "chats": [{"text":
    apply_chat_template(tokenize=False), "ids": apply_chat_template(tokenize=True)}]}."""
    request = [{"kind": "text", "model_dir": str(j["model_dir"]), "texts": list(j["texts"]),
                "chats": [{"messages": c["messages"], "add_generation_prompt": bool(c["add_generation_prompt"]),
                           "tools": c.get("tools")} for c in j["chats"]]} for j in jobs]
    results, _ = _run(request)
    return results
