"""python -m nemoh generate --model DIR --prompt "1 2 3" [--max-new-tokens N] ...: the main job."""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nemoh")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate tokens from a checkpoint")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt", action="append", required=True,
                   help="space-separated token ids; repeat for a batch of prompts")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    args = ap.parse_args(argv)

    import nemoh
    from nemoh.generate import generate

    try:
        prompts = [[int(t) for t in p.split()] for p in args.prompt]
    except ValueError as e:
        ap.error(f"--prompt must be space-separated integers ({e})")
    params = nemoh.load(args.model, dtype=jnp.dtype(args.dtype))
    t0 = time.perf_counter()
    out = generate(params, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, out):
        print(f"prompt {p} -> {o}")
    n = sum(len(o) for o in out)
    print(f"{n} tokens in {dt:.2f} s (includes compilation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
