"""generate_text: text prompts in, text out, streamed; a thin layer over nemoh.generate (token ids)."""

from __future__ import annotations

from typing import Callable

from nemoh.errors import RequestError
from nemoh.generate import generate
from nemoh.model import ModelParams
from nemoh.text.stream import TextStream
from nemoh.text.tokenizer import Tokenizer


def encode_prompts(tokenizer: Tokenizer, prompts: list[str], chat: bool = False) -> list[list[int]]:
    """Each prompt as token ids: plain text (with the tokenizer's own special tokens), or with chat=True
    as one user message through the chat template, ready for the assistant's reply."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError(f"prompts must be a non-empty list of strings, got {prompts!r}"[:200])
    ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) if chat else tokenizer.encode(p) for p in prompts]
    for i, row in enumerate(ids):
        if not row:
            raise RequestError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens")
    return ids


def generate_text(params: ModelParams, tokenizer: Tokenizer, prompts: list[str], *, chat: bool = False,
                  on_text: Callable[[int, str], None] | None = None, on_token=None, **generate_kwargs) -> list[str]:
    """Generate a continuation of each text prompt; returns the new text per prompt.

    on_text(prompt_index, piece) receives the text as it becomes final (never half a character);
    on_token(prompt_index, token) the raw ids. Other keyword arguments go to nemoh.generate. The
    tokenizer's eos token (if it has one) also stops generation, unless ignore_eos is set.
    """
    ids = encode_prompts(tokenizer, prompts, chat)
    streams = [TextStream(tokenizer.decode) for _ in ids]

    def on_new_token(i: int, token: int) -> None:
        if on_token is not None:
            on_token(i, token)
        piece = streams[i].push(token)
        if piece and on_text is not None:
            on_text(i, piece)

    stops = list(generate_kwargs.pop("stop_token_ids", None) or ())
    if tokenizer.eos_token_id is not None and not generate_kwargs.get("ignore_eos", False):
        stops.append(tokenizer.eos_token_id)
    out = generate(params, ids, on_token=on_new_token, stop_token_ids=stops, **generate_kwargs)
    for i, stream in enumerate(streams):
        tail = stream.flush()
        if tail and on_text is not None:
            on_text(i, tail)
    return [tokenizer.decode(o) for o in out]
