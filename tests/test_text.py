"""Tokenizer and chat template against transformers' AutoTokenizer on the same files; streaming
detokenisation; the errors for missing or unsafe tokenizer files."""

from __future__ import annotations

import json
import shutil

import pytest

import nemoh
from nemoh import oracle
from nemoh.text import TextStream
from nemoh.text.chat import render_chat

TEXTS = ["Once upon a time", "Alice said, 'Off with her head!'\n\nThe end.", "Crème brûlée — 日本語 🙂 naïve",
         "  spaces  around  ", "", "<s>special</s> in text"]

# A template using what real chat templates use: namespace, tojson, loop controls, raise_exception,
# reasoning_content, trim/lstrip whitespace control, special-token variables.
RICH_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif %}
{{ bos_token }}<|im_start|>system
{{ ns.system }}
{%- if tools %}

Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
{%- endif %}<|im_end|>
{% for message in messages %}
  {% if message['role'] == 'system' %}{% continue %}{% endif %}
  {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] | trim }}</think>{% endif %}
{{ message['content'] }}<|im_end|>
  {% elif message['role'] in ['user', 'tool'] %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
  {%- else %}{{ raise_exception('Unexpected role: ' + message['role']) }}
  {%- endif %}
  {% if loop.index > 6 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

TOOL = {"type": "function", "function": {"name": "tea_time", "description": "Is it <tea> time?",
                                         "parameters": {"type": "object", "properties": {}}}}
CHATS = [
    {"messages": [{"role": "user", "content": "Who are you?"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Answer like the Hatter."},
                  {"role": "user", "content": " Why is a raven like a writing-desk? "},
                  {"role": "assistant", "content": "I haven't the slightest idea.", "reasoning": "a riddle "},
                  {"role": "user", "content": "Naïve 日本 🙂", "name": None}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Tea?"}, {"role": "assistant", "content": "More tea."}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "What time is it?"}], "add_generation_prompt": True, "tools": [TOOL]},
]


@pytest.fixture(scope="module")
def rich_checkpoint(demo_checkpoint, tmp_path_factory):
    """The demo's tokenizer with RICH_TEMPLATE in a chat_template.jinja file (which overrides
    tokenizer_config.json's template, in transformers and in nemoh)."""
    d = tmp_path_factory.mktemp("rich_template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_checkpoint / name, d / name)
    (d / "chat_template.jinja").write_text(RICH_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def reference(demo_checkpoint, rich_checkpoint):
    """transformers' encodings and chat renderings, for both tokenizer directories (one worker each)."""
    dirs = (demo_checkpoint, rich_checkpoint)
    return dict(zip(dirs, oracle.text([dict(model_dir=d, texts=TEXTS, chats=CHATS) for d in dirs])))


def test_encode_matches_transformers_and_round_trips(demo_checkpoint, reference):
    tok = nemoh.load_tokenizer(demo_checkpoint)
    assert tok.vocab_size == nemoh.NemotronHConfig.from_json_file(demo_checkpoint / "config.json").vocab_size
    for text, ref_ids in zip(TEXTS, reference[demo_checkpoint]["encoded"], strict=True):
        assert tok.encode(text) == ref_ids, text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("which", ["demo", "rich"])
def test_chat_template_equals_transformers(which, demo_checkpoint, rich_checkpoint, reference):
    d = demo_checkpoint if which == "demo" else rich_checkpoint
    tok = nemoh.load_tokenizer(d)
    for chat, ref in zip(CHATS, reference[d]["chats"], strict=True):
        kwargs = {"tools": chat["tools"]} if "tools" in chat else {}
        assert tok.apply_chat_template(chat["messages"], chat["add_generation_prompt"], **kwargs) == ref["text"]
        assert tok.encode_chat(chat["messages"], chat["add_generation_prompt"], **kwargs) == ref["ids"]
    if which == "rich":  # the template's own text proves the file was used, not tokenizer_config.json's
        assert "Tools:" in reference[d]["chats"][3]["text"] and "<think>a riddle</think>" in reference[d]["chats"][1]["text"]


def test_stream_never_splits_a_character(demo_checkpoint):
    tok = nemoh.load_tokenizer(demo_checkpoint)
    text = "Crème brûlée — 日本語 🙂 and more"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    stream = TextStream(tok.decode)
    pieces = [stream.push(t) for t in ids]
    assert "" in pieces  # held back while a character was incomplete
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text
    half = TextStream(tok.decode)  # a sequence cut inside a character: flush gives the replacement char
    cut = tok.encode("日")
    assert [half.push(t) for t in cut[:-1]] == [""] * (len(cut) - 1)
    assert half.flush() == tok.decode(cut[:-1])


def test_missing_tokenizer_names_the_file(tmp_path):
    with pytest.raises(nemoh.CheckpointError, match=r"tokenizer-less/tokenizer\.json not found"):
        nemoh.load_tokenizer(tmp_path / "tokenizer-less")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(nemoh.CheckpointError, match=r"tokenizer\.json: unreadable tokenizer"):
        nemoh.load_tokenizer(tmp_path)


def test_template_errors(demo_checkpoint, tmp_path):
    shutil.copy(demo_checkpoint / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((demo_checkpoint / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(nemoh.CheckpointError, match=r"tokenizer_config\.json: no chat template"):
        nemoh.load_tokenizer(tmp_path).apply_chat_template(user)
    with pytest.raises(nemoh.RequestError, match="unknown role narrator"):
        nemoh.load_tokenizer(demo_checkpoint).apply_chat_template([{"role": "narrator", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(nemoh.CheckpointError, match=r"chat_template\.jinja: the chat template attempted an unsafe"):
        nemoh.load_tokenizer(tmp_path).apply_chat_template(user)
    for escape in ("{{ messages.append(1) }}", "{% set ns = namespace() %}{% set ns._x = 1 %}"):
        with pytest.raises(nemoh.CheckpointError, match="unsafe"):
            render_chat(escape, user)
    with pytest.raises(nemoh.CheckpointError, match=r"malformed chat template \(line 1"):
        render_chat("{% for %}", user)
