"""The token gate: nemoh's greedy tokens against the transformers oracle's on the same checkpoint.

    python -m nemoh.gate --model DIR [--prompt-lengths 3,40,90] [--max-new-tokens 24] [--dtype float32]

prints  TOKEN MATCH: n/N over P prompt(s) (full rows=a, short rows=b, mode=decode) STRICT PASS|DIVERGENCE
A full row matched every oracle token; a short row diverged or stopped early. STRICT PASS needs every
row full. nemoh runs its real path (prefill + jitted decode steps); the oracle re-runs a full forward
per token without any cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from nemoh import validate
from nemoh.config import NemotronHConfig
from nemoh.errors import NemohError

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class GateResult:
    matched: int
    total: int
    full_rows: int
    short_rows: int

    @property
    def strict(self) -> bool:
        return self.short_rows == 0

    def line(self) -> str:
        verdict = "STRICT PASS" if self.strict else "DIVERGENCE"
        return (f"TOKEN MATCH: {self.matched}/{self.total} over {self.full_rows + self.short_rows} prompt(s) "
                f"(full rows={self.full_rows}, short rows={self.short_rows}, mode=decode) {verdict}")


def compare(ours: list[list[int]], reference: list[list[int]]) -> GateResult:
    """Count matching tokens up to each row's first divergence; N counts the oracle's tokens."""
    matched = total = full = 0
    for a, b in zip(ours, reference, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        matched += n
        total += len(b)
        full += int(n == len(b) == len(a))
    return GateResult(matched, total, full, len(reference) - full)


def default_prompts(cfg: NemotronHConfig, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(validate.integer("seed", seed, 0))
    return [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lengths]


def run_gate(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, dtype: str = "float32",
             oracle_dir: str | Path | None = None, generate_fn=None) -> GateResult:
    """Greedy-decode `prompts` with nemoh (from model_dir) and with the oracle (from oracle_dir, default
    the same directory: e.g. a numpy-dequantised copy of a quantised checkpoint), then compare. Every
    argument is checked (RequestError) before loading anything."""
    import nemoh
    from nemoh import oracle
    from nemoh.generate import generate

    if dtype not in DTYPES:
        validate.fail("dtype", dtype, f"must be one of {list(DTYPES)}")
    validate.optional(validate.path, "oracle_dir", oracle_dir)
    validate.integer("max_new_tokens", max_new_tokens, 1)
    if generate_fn is not None and not callable(generate_fn):
        validate.fail("generate_fn", generate_fn, "must be None or a callable like nemoh.generate")
    cfg = NemotronHConfig.from_json_file(validate.path("model_dir", model_dir) / "config.json")
    validate.prompt_list(prompts, cfg.vocab_size)
    params = nemoh.load(model_dir, dtype=dtype)
    ours = (generate_fn or generate)(params, prompts, max_new_tokens=max_new_tokens)
    ref = oracle.greedy([dict(model_dir=str(oracle_dir or model_dir), prompts=prompts,
                              max_new_tokens=max_new_tokens, stop_token_ids=list(params.config.eos_token_ids),
                              dtype=dtype)])[0]
    return compare(ours, [r["tokens"] for r in ref])


def prompt_lengths(text: str) -> list[int]:
    """--prompt-lengths "3,40,90" -> [3, 40, 90]; RequestError unless comma-separated integers >= 1."""
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        validate.fail("--prompt-lengths", text, "must be comma-separated integers >= 1, e.g. 3,40,90")
    return lengths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemoh.gate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory nemoh loads")
    ap.add_argument("--oracle-model", default=None, help="checkpoint transformers loads (default: --model)")
    ap.add_argument("--prompt-lengths", default="3,40,90", help="comma-separated random prompt lengths")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        lengths = prompt_lengths(args.prompt_lengths)
        cfg = NemotronHConfig.from_json_file(Path(args.model) / "config.json")
        prompts = default_prompts(cfg, lengths, args.seed)
        result = run_gate(args.model, prompts, args.max_new_tokens, args.dtype, args.oracle_model)
    except NemohError as e:
        print(f"python -m nemoh.gate: error: {e}", file=sys.stderr)
        return 2
    print(result.line())
    return 0 if result.strict else 1


if __name__ == "__main__":
    sys.exit(main())
