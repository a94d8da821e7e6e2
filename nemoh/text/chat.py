"""Chat templates: a checkpoint's Jinja chat template rendered the way transformers renders it.

Same environment as transformers' apply_chat_template: jinja2's ImmutableSandboxedEnvironment (nothing
in a checkpoint can execute), trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson`
filter that does not HTML-escape, and the globals raise_exception and strftime_now. The template sees
`messages` (None-valued keys dropped, reasoning aliased to `reasoning_content`), `tools`, `documents`,
`add_generation_prompt`, the tokenizer's named special tokens (bos_token, eos_token, ...) and any extra
keyword arguments.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nemoh.errors import CheckpointError, RequestError

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Dict:
    """The template's dict(): builds plain dicts, with no attributes to reach through."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore-prefixed attributes (a sandbox escape route)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox (TemplateSyntaxError on a malformed one)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env.from_string(source)


def _message(m) -> dict:
    if not isinstance(m, dict):
        raise RequestError(f"chat messages must be dicts with 'role' and 'content', got {m!r}"[:200])
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, tools: list[dict] | None = None,
                documents: list[dict] | None = None, origin: str = "(template string)", **kwargs) -> str:
    """The prompt text `template` makes of `messages` (a list of {"role", "content", ...} dicts).

    A malformed or unsafe template raises CheckpointError naming `origin` (where it was read from); a
    template that calls raise_exception (e.g. on an unsupported role) raises RequestError with its message.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("a chat needs a non-empty list of messages")
    try:
        compiled = compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise CheckpointError(f"{origin}: malformed chat template (line {e.lineno}: {e.message})") from None
    try:
        return compiled.render(messages=[_message(m) for m in messages], tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **{**(special_tokens or {}), **kwargs})
    except jinja2.exceptions.SecurityError as e:
        raise CheckpointError(f"{origin}: the chat template attempted an unsafe operation ({e})") from None
    except jinja2.exceptions.TemplateError as e:
        raise RequestError(f"the chat template of {origin} refused the messages: {e}") from None
