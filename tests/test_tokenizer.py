"""Tokenizers from local files (built in the test, never downloaded) and the byte rule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference_lab.api.text import VOCABULARY, placeholder_text
from inference_lab.api.tokenizer import (
    CL100K_PATTERN,
    O200K_PATTERN,
    R50K_PATTERN,
    ByteTokenizer,
    ChatMessage,
    ChatTemplateError,
    HuggingFaceTokenizer,
    TiktokenTokenizer,
    default_chat_text,
    load_tokenizer,
    tiktoken_pattern,
)
from inference_lab.errors import ConfigError
from tests.tokenizer_util import TEMPLATE, train_bpe, write_ranks, write_template

TIKTOKEN_MERGES = [b"th", b"the", b" t", b" the", b"he", b" o", b" of", b"an", b"and", b" and"]


# -- the byte rule ----------------------------------------------------------------------


@given(st.text())
def test_byte_rule_ids_are_reversible_and_count_is_ceil_bytes_over_four(text: str) -> None:
    """Every text encodes to ceil(utf8_bytes / 4) ids (4 bytes each, the last shorter)
    that decode back to it."""
    tok = ByteTokenizer()
    ids = tok.encode(text)
    size = len(text.encode("utf-8", "surrogatepass"))
    assert len(ids) == tok.count(text) == math.ceil(size / 4)
    if not any(0xD800 <= ord(c) < 0xE000 for c in text):  # surrogates are not UTF-8
        assert tok.decode(ids) == text


def test_byte_rule_ids_name_their_length() -> None:
    """A chunk of k bytes has id (1 << 8k) | bytes, so short tails stay distinct."""
    tok = ByteTokenizer()
    assert tok.encode("abcde") == [(1 << 32) | int.from_bytes(b"abcd", "big"), (1 << 8) | 0x65]
    assert tok.encode("\x00") != tok.encode("\x00\x00")
    assert tok.decode(tok.encode("éé€")) == "éé€"


@pytest.mark.parametrize("bad", [0, 5, 255, 1 << 40, -3])
def test_byte_rule_refuses_ids_it_never_makes(bad: int) -> None:
    with pytest.raises(ValueError, match=f"tokens\\[1\\] = {bad}"):
        ByteTokenizer().decode([(1 << 8) | 0x61, bad])


def test_byte_rule_chat_adds_five_percent_over_the_default_rendering() -> None:
    """count_chat is the rendering's count * 105 // 100; encode_chat has no overhead."""
    tok = ByteTokenizer()
    messages = [ChatMessage("user", "x" * 400)]
    text = default_chat_text(messages)
    assert text == "user: " + "x" * 400
    assert tok.count_chat(messages) == tok.count(text) * 105 // 100 == 107
    assert len(tok.encode_chat(messages)) == tok.count(text) == 102


def test_default_chat_text_renders_tools_roles_and_tool_calls() -> None:
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    text = default_chat_text(
        [("system", "be brief", None), ("assistant", "", calls), ("user", "hi", None)],
        [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    )
    assert text.split("\n") == [
        'tools: [{"function":{"name":"f","parameters":{}},"type":"function"}]',
        "system: be brief",
        'assistant: [{"function":{"arguments":"{}","name":"f"},"id":"c","type":"function"}]',
        "user: hi",
    ]


# -- Hugging Face tokenizer.json --------------------------------------------------------


def test_tokenizer_json_counts_exactly_and_round_trips(tmp_path: Path) -> None:
    """A trained tokenizer.json loads (by file or by directory); count is the number of
    ids; decode inverts encode; the count differs from the byte rule's estimate."""
    path = train_bpe(tmp_path / "bpe")
    tok = load_tokenizer(path)
    assert isinstance(tok, HuggingFaceTokenizer) and tok.exact
    assert isinstance(load_tokenizer(tmp_path / "bpe"), HuggingFaceTokenizer)
    text = "the quick brown fox jumps over the lazy dog " * 3
    ids = tok.encode(text)
    assert tok.count(text) == len(ids)
    assert tok.decode(ids) == text
    assert tok.count(text) != ByteTokenizer().count(text)
    assert "400" not in tok.description and "tokens" in tok.description


def test_tokenizer_json_special_tokens_are_counted_when_asked(tmp_path: Path) -> None:
    """A BOS-adding post-processor adds one token to a prompt (vLLM counts it) and none
    when special tokens are off."""
    tok = load_tokenizer(train_bpe(tmp_path, bos=True))
    assert tok.count("hello world") == tok.count("hello world", add_special_tokens=False) + 1
    assert tok.encode("hello")[0] == tok.encode("<s>", add_special_tokens=False)[0]


def test_lone_surrogates_never_reach_the_library(tmp_path: Path) -> None:
    """Text with a lone surrogate is counted (as U+FFFD), not an exception."""
    tok = load_tokenizer(train_bpe(tmp_path))
    assert tok.count("a\ud800b") == tok.count("a\ufffdb")


def test_decode_refuses_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    tok = load_tokenizer(train_bpe(tmp_path))
    with pytest.raises(ValueError, match=f"tokens\\[0\\] = {tok.vocab_size}"):
        tok.decode([tok.vocab_size])


def test_default_chat_template_is_counted_exactly_with_special_tokens(tmp_path: Path) -> None:
    """Without tokenizer_config.json chat is the default rendering, tokenized with special
    tokens and no 5 % overhead."""
    tok = load_tokenizer(train_bpe(tmp_path, bos=True))
    messages = [ChatMessage("user", "hello world")]
    assert tok.render_chat(messages) == "user: hello world"
    assert (
        tok.count_chat(messages) == tok.count("user: hello world") == len(tok.encode_chat(messages))
    )


def test_chat_template_from_tokenizer_config_renders_and_counts(tmp_path: Path) -> None:
    """A chat_template beside tokenizer.json renders the messages (bos_token, tools,
    generation prompt) and is counted without adding special tokens (it writes them)."""
    path = train_bpe(tmp_path, bos=True)
    write_template(tmp_path)
    tok = load_tokenizer(path)
    messages = [ChatMessage("user", "hi"), ChatMessage("assistant", "yo")]
    rendered = tok.render_chat(messages)
    assert rendered == "<s><|user|>hi\n<|assistant|>yo\n<|assistant|>"
    ids = tok.encode(rendered, add_special_tokens=False)
    assert tok.count_chat(messages) == len(ids) == len(tok.encode_chat(messages))
    assert ids.count(tok.encode("<s>", add_special_tokens=False)[0]) == 1
    with_tools = tok.render_chat(messages, [{"type": "function"}], add_generation_prompt=False)
    assert with_tools.endswith('[{"type": "function"}]')


def test_a_chat_template_sees_an_assistant_messages_reasoning_under_both_names(
    tmp_path: Path,
) -> None:
    """An assistant message's earlier reasoning reaches the template as ``reasoning`` and
    ``reasoning_content`` (as vLLM passes it; Qwen3's template reads the latter); another
    role's is not passed, and the default rendering leaves it out."""
    path = train_bpe(tmp_path)
    template = (
        "{% for m in messages %}<|{{ m.role }}|>"
        "{% if m.reasoning_content %}[{{ m.reasoning_content }}|{{ m.reasoning }}]{% endif %}"
        "{{ m.content }}\n{% endfor %}"
    )
    write_template(tmp_path, template)
    tok = load_tokenizer(path)
    messages = [
        ChatMessage("user", "hi", reasoning="not passed"),
        ChatMessage("assistant", "yo", reasoning="thought"),
    ]
    assert tok.render_chat(messages) == "<|user|>hi\n<|assistant|>[thought|thought]yo\n"
    assert default_chat_text(messages) == "user: hi\nassistant: yo"


def test_named_chat_templates_use_the_default_one(tmp_path: Path) -> None:
    path = train_bpe(tmp_path)
    write_template(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(path).render_chat([("user", "x")]) == "DEFAULT"


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([ChatMessage("bad", "x")], "roles must be user or assistant"),
        ([ChatMessage("user", "x")], "access to attribute"),
    ],
)
def test_chat_template_refusals_are_chat_template_errors(
    tmp_path: Path, messages: list[ChatMessage], fragment: str
) -> None:
    """raise_exception and the sandbox's refusals (no attribute escapes) become a
    ChatTemplateError the HTTP layer answers with a 400."""
    path = train_bpe(tmp_path)
    template = TEMPLATE + "{% if messages[0].role == 'user' %}{{ ''.__class__.__mro__ }}{% endif %}"
    write_template(tmp_path, template)
    tok = load_tokenizer(path)
    with pytest.raises(ChatTemplateError, match=fragment):
        tok.render_chat(messages)


# -- tiktoken rank files ----------------------------------------------------------------


def test_tiktoken_rank_file_counts_and_round_trips(tmp_path: Path) -> None:
    """A rank file built here (256 bytes + merges) loads with the GPT-2 pattern (a small
    vocabulary) and merges by rank: ' the' is one token."""
    path = write_ranks(tmp_path / "tiny.tiktoken", TIKTOKEN_MERGES)
    tok = load_tokenizer(path)
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == 256 + len(TIKTOKEN_MERGES)
    assert tok.encode(" the") == [256 + TIKTOKEN_MERGES.index(b" the")]
    text = "the of and the end ü"
    assert tok.decode(tok.encode(text)) == text
    assert tok.count(text) == len(tok.encode(text)) < len(text.encode())


def test_tiktoken_files_are_sniffed_by_content(tmp_path: Path) -> None:
    """A rank file under another name is recognised (it is not a JSON object)."""
    path = write_ranks(tmp_path / "ranks.txt", TIKTOKEN_MERGES)
    assert isinstance(load_tokenizer(path), TiktokenTokenizer)


def test_tiktoken_pattern_follows_the_vocabulary_size() -> None:
    assert tiktoken_pattern(50_257) == R50K_PATTERN
    assert tiktoken_pattern(100_256) == CL100K_PATTERN
    assert tiktoken_pattern(128_000) == CL100K_PATTERN
    assert tiktoken_pattern(199_998) == O200K_PATTERN


# -- loading errors ---------------------------------------------------------------------


def _load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_tokenizer(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_loading_errors_are_one_line_naming_the_file(tmp_path: Path) -> None:
    """Each unusable tokenizer is a one-line ConfigError that starts with its path."""
    missing = tmp_path / "missing.json"
    assert _load_error(missing).startswith(f"{missing}: ")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    assert "must hold tokenizer.json" in _load_error(empty_dir)
    not_json = tmp_path / "bad" / "tokenizer.json"
    not_json.parent.mkdir()
    not_json.write_text('{"version": "1.0", "model": 7}')
    assert _load_error(not_json).startswith(f"{not_json}: not a Hugging Face tokenizer.json")
    bad_rank = tmp_path / "bad.tiktoken"
    bad_rank.write_text("dGhl 0\nnot-base64! 1\n")
    assert _load_error(bad_rank).startswith(f"{bad_rank}:2: not a tiktoken rank line")
    empty_ranks = tmp_path / "empty.tiktoken"
    empty_ranks.write_text("\n")
    assert "no tiktoken ranks" in _load_error(empty_ranks)


def test_broken_chat_templates_fail_at_load(tmp_path: Path) -> None:
    """A template that does not compile, or a config that is not JSON, fails the load
    naming tokenizer_config.json."""
    path = train_bpe(tmp_path)
    write_template(tmp_path, "{% for m in messages %}")
    message = _load_error(path)
    assert message.startswith(f"{tmp_path / 'tokenizer_config.json'}: chat_template:")
    (tmp_path / "tokenizer_config.json").write_text("{nope")
    assert _load_error(path).startswith(f"{tmp_path / 'tokenizer_config.json'}: cannot read")


def test_a_missing_tokenizer_library_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the library installed, loading names the file and the package to add."""
    import sys

    path = train_bpe(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    message = _load_error(path)
    assert message.startswith(f"{path}: ") and "'tokenizers' package" in message


def _word_merges() -> list[bytes]:
    """Merges that make each placeholder word one token in the form the served text
    carries it: " word" (and "the" without the space, the first word)."""
    merges: list[bytes] = []
    for form in ["the", *(f" {w}" for w in VOCABULARY)]:
        data = form.encode()
        for k in range(2, len(data) + 1):
            if data[:k] not in merges:
                merges.append(data[:k])
    return merges


@pytest.mark.parametrize("tokens", [1, 2, 50, 51, 200, 1000])
def test_a_client_tokenizer_counts_the_served_text_as_completion_tokens(
    tmp_path: Path, tokens: int
) -> None:
    """In a BPE vocabulary where each placeholder word is one token (as it is in
    cl100k_base and GPT-2's, scripts/check_placeholder_tokens.py), the text a client
    receives for an n-token response — streamed or not, the last word carries no trailing
    space — counts exactly n tokens."""
    tokenizer = load_tokenizer(write_ranks(tmp_path / "words.tiktoken", _word_merges()))
    served = placeholder_text(tokens).rstrip(" ")
    assert tokenizer.count(served, add_special_tokens=False) == tokens
    # with the trailing space, the text would count one token too many
    assert tokenizer.count(placeholder_text(tokens), add_special_tokens=False) == tokens + 1
