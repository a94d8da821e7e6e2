"""Quickstart: load the demo checkpoint, look at it, generate text and token ids, save and reload.

    python examples/quickstart.py
"""

from __future__ import annotations

import tempfile

import nemoh

DEMO = "checkpoints/alice-nemotron-h"


def main() -> list[str]:
    params = nemoh.load(DEMO)                      # bfloat16 by default; HF layout, NVFP4/FP8 kept packed
    print(params)                                  # one screen: pattern, dtype, formats and bytes by kind
    tokenizer = nemoh.load_tokenizer(DEMO)
    texts = nemoh.generate_text(params, tokenizer, ["Alice was"], max_new_tokens=24)
    print(texts[0])
    ids = nemoh.generate(params, [tokenizer.encode("The Queen")], max_new_tokens=8, temperature=0.7, seed=3)
    print(ids[0], "->", tokenizer.decode(ids[0]))
    with tempfile.TemporaryDirectory() as tmp:
        nemoh.save(params, f"{tmp}/params")        # orbax; restores straight onto the device
        again = nemoh.load(f"{tmp}/params")
    assert nemoh.generate(again, [tokenizer.encode("The Queen")], max_new_tokens=8, temperature=0.7, seed=3) == ids
    return texts


if __name__ == "__main__":
    main()
