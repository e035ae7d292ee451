"""Prompt tokenizers: a real BPE from a local file, or the byte rule when there is none.

The serve app counts every prompt with one :class:`Tokenizer` per model; ``POST /tokenize``
and ``/detokenize`` use the same object. Pure code: no trio, no quart, no network.

Rule 1: nothing is ever downloaded: a tokenizer is read from one local file (a Hugging
        Face ``tokenizer.json``, a tiktoken rank file, or a directory holding a
        ``tokenizer.json``); a file that cannot be used is a one-line
        :class:`~inference_lab.errors.ConfigError` naming it.
Rule 2: every tokenizer has the same protocol: ``count``/``encode``/``decode`` for text,
        ``render_chat``/``encode_chat``/``count_chat`` for chat messages.
Rule 3: without a file, :class:`ByteTokenizer` counts ``ceil(utf8_bytes / 4)`` tokens with
        reversible ids, and its chat counts add 5 % (``raw * 105 // 100``) for the
        template tokens it cannot see.
Rule 4: chat prompts are counted over the rendered messages: the ``chat_template`` of a
        ``tokenizer_config.json`` beside the tokenizer file (run in jinja2's sandbox, as
        Hugging Face runs it; tokenized without adding special tokens, which the template
        writes), else :func:`default_chat_text` (tokenized with them).
Rule 5: text prompts are tokenized as vLLM tokenizes them, with special tokens unless the
        caller says otherwise; a lone surrogate in client text becomes U+FFFD, so encoding
        never fails.
Rule 6: a tiktoken file carries no split pattern, so one is chosen by vocabulary size
        (:func:`tiktoken_pattern`).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import importlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jinja2
import jinja2.sandbox

from inference_lab.errors import ConfigError, truncate_echo

__all__ = [
    "ByteTokenizer",
    "ChatMessage",
    "ChatTemplateError",
    "HuggingFaceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "default_chat_text",
    "load_tokenizer",
]


class ChatMessage(NamedTuple):
    """One chat message as the counting and the templates see it (content is text)."""

    role: str
    content: str
    tool_calls: list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    #: An assistant message's earlier reasoning (``reasoning`` or ``reasoning_content``):
    #: a chat template sees it under both names, as vLLM passes it; the default rendering
    #: leaves it out.
    reasoning: str | None = None


class ChatTemplateError(ValueError):
    """Raised by :meth:`Tokenizer.render_chat` when a model's chat template refuses the
    messages (``raise_exception`` in the template, or a template runtime error). The HTTP
    layer answers 400 naming ``messages``."""


def _sorted_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def default_chat_text(messages: Sequence[Sequence[Any]], tools: Sequence[Any] | None = None) -> str:
    """The default chat rendering (Rule 4): ``tools: <JSON>`` (if any tools), then one
    ``<role>: <content>`` line per message (tool calls appended as compact sorted JSON,
    after a newline when the content is not empty), joined with newlines.

    ``messages`` are :class:`ChatMessage` values or ``(role, content, tool_calls)``
    tuples."""
    lines: list[str] = []
    if tools:
        lines.append(f"tools: {_sorted_json(tools)}")
    for message in messages:
        role, text = message[0], message[1]
        tool_calls = message[2] if len(message) > 2 else None
        if tool_calls:
            calls = _sorted_json(tool_calls)
            text = f"{text}\n{calls}" if text else calls
        lines.append(f"{role}: {text}")
    return "\n".join(lines)


def _clean(text: str) -> str:
    """``text`` with any lone surrogate replaced by U+FFFD (tokenizer libraries take
    only valid Unicode)."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text


class Tokenizer(Protocol):
    """What the serving layer needs from a tokenizer (Rule 2)."""

    #: Shown at startup and in ``/tokenize`` errors, e.g. ``tokenizer.json (32,000 tokens)``.
    description: str
    #: False for the byte rule (its counts are an estimate of a real tokenizer's).
    exact: bool
    #: Ids below this are valid for :meth:`decode` (the byte rule: see its class).
    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def count(self, text: str, *, add_special_tokens: bool = True) -> int: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(
        self,
        messages: Sequence[Sequence[Any]],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str: ...

    def encode_chat(
        self,
        messages: Sequence[Sequence[Any]],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool | None = None,
    ) -> list[int]: ...

    def count_chat(
        self, messages: Sequence[Sequence[Any]], tools: Sequence[Any] | None = None
    ) -> int: ...


# ---------------------------------------------------------------------------------------
# the byte rule


class ByteTokenizer:
    """The byte rule as a tokenizer: a token is up to 4 bytes of the text's UTF-8.

    Token ids are reversible: the id of a chunk of ``k`` bytes (1..4) is
    ``(1 << 8k) | int.from_bytes(chunk, "big")``, so the leading 1 bit says how many bytes
    follow. Only the last token of a text is shorter than 4 bytes. ``count(text)`` is
    ``ceil(utf8_bytes / 4)`` (= ``len(encode(text))``); ``count_chat`` adds 5 % template
    overhead to the default rendering's count, so it is larger than ``len(encode_chat)``
    (which has no template to see). Decoding joins the bytes and decodes them as UTF-8
    (invalid sequences become U+FFFD).
    """

    description = "byte rule (ceil(utf8_bytes / 4), chat +5 %)"
    exact = False
    vocab_size = 1 << 33

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        out = []
        for start in range(0, len(data), 4):
            chunk = data[start : start + 4]
            out.append((1 << (8 * len(chunk))) | int.from_bytes(chunk, "big"))
        return out

    def count(self, text: str, *, add_special_tokens: bool = True) -> int:
        if text.isascii():
            return -(-len(text) // 4)
        return -(-len(text.encode("utf-8", "surrogatepass")) // 4)

    def decode(self, ids: Sequence[int]) -> str:
        parts = []
        for i, token in enumerate(ids):
            bits = token.bit_length() - 1
            size = bits // 8
            if token <= 0 or bits % 8 or not 1 <= size <= 4:
                raise ValueError(
                    f"tokens[{i}] = {truncate_echo(str(token))} is not a token id of the byte rule"
                )
            parts.append((token ^ (1 << bits)).to_bytes(size, "big"))
        return b"".join(parts).decode("utf-8", "replace")

    def render_chat(
        self,
        messages: Sequence[Sequence[Any]],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        return default_chat_text(messages, tools)

    def encode_chat(
        self,
        messages: Sequence[Sequence[Any]],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools))

    def count_chat(
        self, messages: Sequence[Sequence[Any]], tools: Sequence[Any] | None = None
    ) -> int:
        return self.count(default_chat_text(messages, tools)) * 105 // 100


# ---------------------------------------------------------------------------------------
# chat templates


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_text(value: Any) -> str:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken
    object with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


class _ChatTemplate:
    """A ``tokenizer_config.json`` chat template, compiled once in jinja2's immutable
    sandbox with the globals Hugging Face provides (``raise_exception``, ``strftime_now``,
    a ``tojson`` that keeps non-ASCII)."""

    def __init__(self, source: str, bos_token: str, eos_token: str, where: Path) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"{where}: chat_template: {_one_line(str(exc))}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Sequence[Any]],
        tools: Sequence[Any] | None,
        add_generation_prompt: bool,
    ) -> str:
        dicts = []
        for message in messages:
            m = ChatMessage(*message)
            entry: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                entry["tool_calls"] = m.tool_calls
            if m.name is not None:
                entry["name"] = m.name
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.reasoning is not None and m.role == "assistant":
                entry["reasoning"] = entry["reasoning_content"] = m.reasoning
            dicts.append(entry)
        try:
            return self.template.render(
                messages=dicts,
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
            raise ChatTemplateError(
                f"the model's chat template refused the messages: {_one_line(str(exc))}"
            ) from None
        except RecursionError:
            raise ChatTemplateError("the model's chat template recursed too deeply") from None


def _require(module: str, path: Path) -> Any:
    """Import a tokenizer library on first use (a heavy import, paid only when a tokenizer
    is configured); ConfigError naming the file when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{path}: reading this tokenizer needs the '{module}' package "
            "(pip install 'inference-lab[tokenizer]')"
        ) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _load_chat_template(tokenizer_file: Path) -> _ChatTemplate | None:
    """The chat template of the ``tokenizer_config.json`` beside ``tokenizer_file``, or
    None when there is no such file or it has no ``chat_template``."""
    config_path = tokenizer_file.parent / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config_path}: cannot read: {_one_line(str(exc))}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: must hold a JSON object")
    source = config.get("chat_template")
    if source is None:
        return None
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default", next(iter(named.values()), None))
    if not isinstance(source, str):
        raise ConfigError(f"{config_path}: chat_template: must be a string")
    return _ChatTemplate(
        source,
        _token_text(config.get("bos_token")),
        _token_text(config.get("eos_token")),
        config_path,
    )


class _RealTokenizer:
    """Chat rendering shared by the two file-backed tokenizers (Rule 4)."""

    exact = True
    description: str
    vocab_size: int
    _template: _ChatTemplate | None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    @property
    def has_chat_template(self) -> bool:
        """Whether chat prompts are rendered by the model's own template (Rule 4)."""
        return self._template is not None

    def count(self, text: str, *, add_special_tokens: bool = True) -> int:
        return len(self.encode(text, add_special_tokens=add_special_tokens))

    def _check_ids(self, ids: Iterable[int]) -> None:
        limit = self.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= token < limit:
                raise ValueError(
                    f"tokens[{i}] = {truncate_echo(str(token))} is not a token id of this tokenizer "
                    f"(ids are 0..{limit - 1})"
                )

    def render_chat(
        self,
        messages: Sequence[Sequence[Any]],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        if self._template is None:
            return default_chat_text(messages, tools)
        return self._template.render(messages, tools, add_generation_prompt)

    def encode_chat(
        self,
        messages: Sequence[Sequence[Any]],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        text = self.render_chat(messages, tools, add_generation_prompt=add_generation_prompt)
        if add_special_tokens is None:
            add_special_tokens = self._template is None
        return self.encode(text, add_special_tokens=add_special_tokens)

    def count_chat(
        self, messages: Sequence[Sequence[Any]], tools: Sequence[Any] | None = None
    ) -> int:
        return len(self.encode_chat(messages, tools))


# ---------------------------------------------------------------------------------------
# Hugging Face tokenizer.json


class HuggingFaceTokenizer(_RealTokenizer):
    """A ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        tokenizers = _require("tokenizers", path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
            raise ConfigError(
                f"{path}: not a Hugging Face tokenizer.json: {_one_line(str(exc))}"
            ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = _load_chat_template(path)
        chat = "its chat template" if self._template else "the default chat template"
        self.description = f"{path} ({self.vocab_size:,} tokens, {chat})"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(_clean(text), add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        self._check_ids(ids)
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return text


# ---------------------------------------------------------------------------------------
# tiktoken rank files

R50K_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def tiktoken_pattern(num_ranks: int) -> str:
    """The split pattern used for a rank file of ``num_ranks`` tokens (Rule 6): up to
    60,000 ranks the GPT-2 pattern (``r50k_base``, ``p50k_base``), from 190,000 ranks
    ``o200k_base``'s, otherwise ``cl100k_base``'s (also the pattern of most 100k-128k
    vocabularies derived from it)."""
    if num_ranks <= 60_000:
        return R50K_PATTERN
    if num_ranks >= 190_000:
        return O200K_PATTERN
    return CL100K_PATTERN


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The ``<base64 token> <rank>`` lines of a tiktoken file; ConfigError naming the file
    and line for anything else."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            raise ConfigError(
                f"{path}:{lineno}: not a tiktoken rank line (expected '<base64 token> <rank>')"
            ) from None
        ranks[token] = rank
    if not ranks:
        raise ConfigError(f"{path}: no tiktoken ranks in the file")
    return ranks


class TiktokenTokenizer(_RealTokenizer):
    """A tiktoken BPE built from a local rank file and the pattern of Rule 6. It has no
    special tokens (a rank file names none), so ``add_special_tokens`` adds nothing."""

    def __init__(self, path: Path) -> None:
        tiktoken = _require("tiktoken", path)
        ranks = read_tiktoken_ranks(path)
        try:
            self._enc = tiktoken.Encoding(
                name=path.stem,
                pat_str=tiktoken_pattern(len(ranks)),
                mergeable_ranks=ranks,
                special_tokens={},
            )
        except Exception as exc:  # noqa: BLE001 - tiktoken raises plain errors
            raise ConfigError(
                f"{path}: not a usable tiktoken file: {_one_line(str(exc))}"
            ) from None
        self.vocab_size = self._enc.n_vocab
        self._template = _load_chat_template(path)
        chat = "its chat template" if self._template else "the default chat template"
        self.description = f"{path} ({self.vocab_size:,} tokens, tiktoken, {chat})"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._enc.encode_ordinary(_clean(text))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        self._check_ids(ids)
        try:
            text: str = self._enc.decode(list(ids))
            return text
        except KeyError as exc:  # a gap in the ranks
            raise ValueError(f"token id {exc.args[0]} is not in this tokenizer") from None


# ---------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Read the tokenizer at ``path`` (Rule 1): a directory with ``tokenizer.json``, a
    ``*.tiktoken`` rank file, or a ``tokenizer.json``-format file (any other name is
    sniffed: a JSON object is read as ``tokenizer.json``, anything else as ranks).
    Raises ConfigError (one line naming the file). Called once per model at startup."""
    file = Path(path)
    if file.is_dir():
        inside = file / "tokenizer.json"
        if not inside.is_file():
            raise ConfigError(f"{file}: a tokenizer directory must hold tokenizer.json")
        file = inside
    if not file.is_file():
        raise ConfigError(f"{file}: no such tokenizer file")
    if file.suffix == ".tiktoken":
        return TiktokenTokenizer(file)
    if file.suffix != ".json":
        try:
            with file.open("rb") as fh:
                head = fh.read(64).lstrip()
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None
        if not head.startswith(b"{"):
            return TiktokenTokenizer(file)
    return HuggingFaceTokenizer(file)
