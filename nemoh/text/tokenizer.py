"""load_tokenizer(dir): a checkpoint's own tokenizer, as transformers would use it.

The vocabulary, merges, normaliser, pre-tokeniser and post-processor come from tokenizer.json, read by
the `tokenizers` library; the named special tokens and the chat template come from tokenizer_config.json
(a chat_template.jinja file, when present, takes the template's place, as in transformers). Only JSON
and template text are read; the template renders in a sandbox (nemoh.text.chat).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import tokenizers

from nemoh.errors import CheckpointError
from nemoh.io.json_file import read_json
from nemoh.text.chat import render_chat

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """backend: the `tokenizers` Tokenizer of tokenizer.json; special_tokens: {"bos_token": "<s>", ...};
    chat_template: Jinja source or None; template_origin: the file it came from (named in errors)."""

    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str]
    chat_template: str | None
    template_origin: str

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.backend.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """text -> token ids; add_special_tokens applies tokenizer.json's post-processor (e.g. a BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat rendered as prompt text (equal to transformers' apply_chat_template(tokenize=False))."""
        if self.chat_template is None:
            raise CheckpointError(f"{self.template_origin}: no chat template (neither a \"chat_template\" entry "
                                  f"in {TOKENIZER_CONFIG} nor a {CHAT_TEMPLATE_FILE} file)")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, origin=self.template_origin, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """The rendered chat as token ids: the template writes its own special tokens, so none are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken-like {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: dict) -> tuple[str | None, str]:
    """(template source or None, where it was read from)."""
    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    origin = str(directory / TOKENIZER_CONFIG)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates [{"name": ..., "template": ...}]: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{origin}: chat_template must be a string or a list of named templates")
    return template, origin


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the checkpoint directory `path` (CheckpointError naming the file when
    tokenizer.json is missing or unreadable, or tokenizer_config.json is malformed)."""
    directory = Path(path)
    tok_file = directory / TOKENIZER_FILE
    if not tok_file.is_file():
        raise CheckpointError(f"{tok_file} not found: text needs the checkpoint's tokenizer "
                              "(token ids work without one)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:  # the Rust reader raises a bare Exception on malformed JSON
        raise CheckpointError(f"{tok_file}: unreadable tokenizer ({e})") from None
    config_file = directory / TOKENIZER_CONFIG
    config = read_json(config_file) if config_file.is_file() else {}
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    template, origin = _chat_template(directory, config)
    return Tokenizer(backend, special, template, origin)
