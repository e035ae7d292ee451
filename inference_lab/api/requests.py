"""The completion requests the server parses, counted and decided before they run.

Bodies are validated by :mod:`inference_lab.api.schema`; this module turns them into a
:class:`ParsedRequest`, the one value the runtime and the response builders use.

Rule 1: prompt tokens are counted by the model's :class:`~inference_lab.api.tokenizer.Tokenizer`
        (a real tokenizer counts exactly, chat over the rendered messages) or, without
        one, by the byte rule ``ceil(utf8_bytes / 4)`` with 5 % chat template overhead;
        token-id prompts count exactly.
Rule 2: everything about the output is decided at parse time, because the text is known:
        ``stop`` fixes how many tokens are generated and the text returned
        (:func:`~inference_lab.api.text.stop_point`); ``n`` choices all carry the same
        text.
Rule 3: a parse function raises only :class:`ApiError` (400), which carries the whole
        envelope.
Rule 4: given a :class:`~inference_lab.api.hashing.PromptHashing` (the model caches
        prefixes), the prompt is counted and hashed in one pass
        (:mod:`inference_lab.api.hashing`): the request carries its block hashes, and the
        count is the same as without hashing.
Rule 5: a request's session, for the ``session_affinity`` router, is its
        ``prompt_cache_key`` (OpenAI's key for requests that share a cache), else its
        ``user`` (on ``/v1/messages``, Anthropic's ``metadata.user_id``): the string's
        8-byte BLAKE2b digest as an unsigned integer (:func:`session_key`); neither, or an
        empty string: no session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from inference_lab.api.hashing import PromptHashing, hash_chat, hash_text, hash_token_ids
from inference_lab.api.prompt_logprobs import prompt_token_texts
from inference_lab.api.schema import (
    ChatBody,
    CompletionBody,
    StreamOptions,
    chat_messages,
    in_range,
    invalid_value,
    structure,
)
from inference_lab.api.text import WORDS, placeholder_text, stop_point
from inference_lab.api.tokenizer import ByteTokenizer, ChatTemplateError, Tokenizer
from inference_lab.errors import ApiError, truncate_echo

__all__ = [
    "BYTE_TOKENIZER",
    "MAX_BODY_BYTES",
    "MAX_CAPACITY",
    "MAX_PROMPTS",
    "MAX_RESPONSE_WORK",
    "check_work",
    "CapacityRequest",
    "ParsedRequest",
    "count_chat_tokens",
    "count_text_tokens",
    "parse_capacity_request",
    "parse_chat_request",
    "parse_completion_request",
    "parse_completion_requests",
    "session_key",
    "session_of",
]

#: The largest request body the server reads.
MAX_BODY_BYTES = 2 * 1024 * 1024
#: Upper bound of ``max_num_seqs`` and ``max_waiting`` in a capacity change: far above any
#: replica's batch (and any queue worth holding), far below what overflows a counter.
MAX_CAPACITY = 1_000_000

#: Without a tokenizer file prompts are counted by the byte rule.
BYTE_TOKENIZER: Tokenizer = ByteTokenizer()


def count_text_tokens(text: str) -> int:
    """``ceil(utf8_bytes / 4)``: the prompt-token count of a text without a tokenizer."""
    return BYTE_TOKENIZER.count(text)


def count_chat_tokens(messages: Sequence[Sequence[Any]], tools: Sequence[Any] | None = None) -> int:
    """Chat prompt tokens by the byte rule: the default rendering's count plus 5 %
    template overhead (``raw * 105 // 100``)."""
    return BYTE_TOKENIZER.count_chat(messages, tools)


@attrs.frozen(kw_only=True)
class ParsedRequest:
    """A validated request, normalised for the runtime and the response builders.

    ``prompt_tokens`` is the count usage reports (the engine gets ``max(1, ...)``);
    ``echo_text`` is the prompt text a completions ``echo`` prepends ("" otherwise).
    ``n`` choices share the prompt (usage counts it once) and all carry the same text.
    ``stop_after`` is the number of tokens each choice generates before a stop string
    completes (the engine must stop there; None: no stop string completes within
    ``max_tokens``), and ``stop_chars`` the length of the text then returned (the
    placeholder text cut before the stop string). ``logprobs`` is None when no logprobs
    were asked for, else the number of alternatives per token (chat ``top_logprobs``,
    completions ``logprobs``).
    """

    kind: Literal["chat", "completions"]
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    priority: int
    echo_text: str = ""
    n: int = 1
    stop_after: int | None = None
    stop_chars: int | None = None
    logprobs: int | None = None
    #: The hash chain of the prompt and the answer (Rule 4; empty without hashing).
    block_hashes: tuple[int, ...] = ()
    #: The token ids hashed (numpy int64), kept only for the KV-events publisher.
    hashed_tokens: Any = None
    #: vLLM's ``ignore_eos``: run to ``max_tokens`` (or a stop string), no drawn length.
    ignore_eos: bool = False
    #: vLLM's ``min_tokens``: a drawn length is at least this (capped by ``output_cap``).
    min_tokens: int = 0
    #: With ``echo`` and ``logprobs`` (completions): the text of each prompt token, whose
    #: logprobs come first (:mod:`inference_lab.api.prompt_logprobs`).
    echo_tokens: tuple[str, ...] = ()
    #: The index of this request's first choice in its body (a batch of prompts:
    #: ``prompt index x n``).
    index_base: int = 0
    #: Its session for the ``session_affinity`` router (Rule 5; None: none).
    session: int | None = None

    @property
    def engine_max_tokens(self) -> int:
        """``max_tokens`` as the engine sees it: a completions request with
        ``max_tokens: 0`` scores its prompt in one prefill step, of one (unreported)
        token."""
        return max(1, self.max_tokens)

    @property
    def output_cap(self) -> int:
        """The most tokens a choice can generate: ``stop_after`` or ``max_tokens``. The
        runtime caps its drawn response length (``target``) with it."""
        return self.stop_after if self.stop_after is not None else self.max_tokens

    def stopped(self, completion_tokens: int) -> bool:
        """Whether a choice of ``completion_tokens`` tokens ended on a stop string."""
        return self.stop_after is not None and completion_tokens >= self.stop_after

    def finish_reason(self, engine_reason: str, completion_tokens: int) -> str:
        """The reported finish reason: ``stop`` when a stop string completed (even in the
        last token ``max_tokens`` allows, as vLLM reports it), else the engine's."""
        return "stop" if self.stopped(completion_tokens) else engine_reason

    def output_text(self, completion_tokens: int) -> str:
        """The text of one choice of ``completion_tokens`` tokens as a non-streaming body
        holds it: cut before the stop string when one completed (verbatim, so streamed
        frames concatenate to it), else the placeholder words with the trailing space
        stripped."""
        if self.stop_after is not None and completion_tokens >= self.stop_after:
            return placeholder_text(self.stop_after)[: self.stop_chars]
        return placeholder_text(completion_tokens).rstrip(" ")


#: The most token entries one request may ask the server to produce: ``n`` choices times
#: their ``max_tokens`` (plus the prompt each echoes), each token with ``1 +`` its logprobs
#: alternatives. A body at the limit is tens of MB; vLLM bounds ``n`` and the logprobs
#: alone, which still lets a 140-byte request ask for hundreds of MB.
MAX_RESPONSE_WORK = 1 << 20


def check_work(parsed: ParsedRequest) -> ParsedRequest:
    """``parsed``, or a 400 ``invalid_value`` when it asks for more than
    :data:`MAX_RESPONSE_WORK` token entries (naming the fields that multiply). The serve
    route calls it after the context check, so a ``max_tokens`` the model's context can
    never hold is a ``context_length_exceeded`` first."""
    alternatives = parsed.logprobs or 0
    echo = parsed.prompt_tokens if parsed.echo_text else 0
    work = parsed.n * (parsed.max_tokens + echo) * (1 + alternatives)
    if work <= MAX_RESPONSE_WORK:
        return parsed
    top = "top_logprobs" if parsed.kind == "chat" else "logprobs"
    tokens = "max_tokens" if not echo else "(max_tokens + echoed prompt tokens)"
    raise invalid_value(
        "max_tokens",
        f"n ({parsed.n}) x {tokens} ({parsed.max_tokens + echo}) x (1 + {top} "
        f"({alternatives})) = {work:,} token entries, more than this server's "
        f"{MAX_RESPONSE_WORK:,} per request: lower n, max_tokens or {top}",
    )


def _check_best_of(best_of: int | None, n: int) -> None:
    if best_of is not None and best_of != n:
        raise ApiError(
            400,
            "unsupported_value",
            f"best_of is not supported: each of the n = {n} choices is generated once "
            f"(best_of must be absent or equal n), got {truncate_echo(str(best_of))}",
            "best_of",
        )


def _stop_fields(stops: Any, max_tokens: int) -> dict[str, Any]:
    """ParsedRequest's ``stop_after`` and ``stop_chars`` for the structured ``stop``."""
    point = stop_point(stops, max_tokens) if stops else None
    if point is None:
        return {}
    return {"stop_after": point[0], "stop_chars": point[1]}


def _include_usage(stream: bool, options: StreamOptions | None) -> bool:
    return stream and options is not None and bool(options.include_usage)


def _length_fields(
    ignore_eos: bool | None, min_tokens: int | None, max_tokens: int
) -> dict[str, Any]:
    """ParsedRequest's ``ignore_eos`` and ``min_tokens`` (vLLM's sampling parameters, which
    decide an answer's length here); ``min_tokens`` above ``max_tokens`` is a 400, as in
    vLLM."""
    if min_tokens is not None and min_tokens > max_tokens:
        raise invalid_value(
            "min_tokens",
            f"min_tokens must be less than or equal to max_tokens ({max_tokens}), got {min_tokens}",
        )
    return {"ignore_eos": bool(ignore_eos), "min_tokens": min_tokens or 0}


def parse_chat_request(
    raw: dict[str, Any],
    default_max_tokens: int,
    *,
    tokenizer: Tokenizer | None = None,
    hashing: PromptHashing | None = None,
) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body and count its prompt with ``tokenizer``
    (None: the byte rule), hashing it with ``hashing`` (Rule 4); raises :class:`ApiError`
    (400)."""
    body: ChatBody = structure(raw, ChatBody)
    for legacy in ("functions", "function_call"):
        if raw.get(legacy) is not None:
            raise ApiError(
                400,
                "unsupported_value",
                f"{legacy} is the deprecated spelling of tools / tool_choice, which vLLM "
                "ignores (its answer would call no function): send tools and tool_choice",
                legacy,
            )
    n = body.n or 1
    _check_best_of(body.best_of, n)
    if body.top_logprobs and not body.logprobs:
        raise invalid_value(
            "top_logprobs", "top_logprobs needs logprobs set to true, got logprobs: false"
        )
    messages = chat_messages(body.messages, body.tools)
    tok = tokenizer if tokenizer is not None else BYTE_TOKENIZER
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
    stop = _stop_fields(body.stop, max_tokens)
    hashed: dict[str, Any] = {}
    try:
        if hashing is None:
            prompt_tokens = tok.count_chat(messages, body.tools)
        else:
            answer, answer_tokens = hashing.answer(
                max_tokens, stop.get("stop_after"), stop.get("stop_chars")
            )
            result = hash_chat(tok, messages, body.tools, answer, answer_tokens, hashing)
            prompt_tokens = result.count
            hashed = {"block_hashes": result.hashes, "hashed_tokens": result.tokens}
    except ChatTemplateError as exc:
        raise invalid_value("messages", truncate_echo(str(exc))) from None
    stream = bool(body.stream)
    return ParsedRequest(
        kind="chat",
        model=body.model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_include_usage(stream, body.stream_options),
        priority=body.priority or 0,
        n=n,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        session=session_key(body.prompt_cache_key, body.user),
        **stop,
        **hashed,
        **_length_fields(body.ignore_eos, body.min_tokens, max_tokens),
    )


def session_key(*keys: str | None) -> int | None:
    """Rule 5: the session of the first of ``keys`` that is a non-empty string (None:
    none is)."""
    for key in keys:
        if key:
            digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8)
            return int.from_bytes(digest.digest(), "big")
    return None


def session_of(fields: Sequence[tuple[str, Any]]) -> int | None:
    """Rule 5 for a body read by hand: ``fields`` are (name, raw value) pairs in order of
    precedence; a value that is neither a string nor null is a 400 naming its field."""
    for param, value in fields:
        if value is not None and type(value) is not str:
            raise invalid_value(param, f"{param} must be a string")
    return session_key(*(value for _, value in fields))


def _token_echo(ids: tuple[int, ...]) -> str:
    return "".join(WORDS[t % len(WORDS)] for t in ids)


#: The most prompts one ``/v1/completions`` request may carry (each is an engine request).
MAX_PROMPTS = 2048


def parse_completion_requests(
    raw: dict[str, Any],
    default_max_tokens: int,
    *,
    tokenizer: Tokenizer | None = None,
    hashing: PromptHashing | None = None,
) -> tuple[ParsedRequest, ...]:
    """Validate a ``/v1/completions`` body: one :class:`ParsedRequest` per prompt (a batch
    of prompts is a request each, as vLLM serves it; choice ``c`` of prompt ``i`` has
    index ``i x n + c``), each counted with ``tokenizer`` (None: the byte rule; token ids
    count exactly) and hashed with ``hashing`` (Rule 4). ``max_tokens`` may be 0 (the
    prompt is scored: with ``echo`` and ``logprobs``, its own logprobs); ``suffix`` is
    refused, as vLLM refuses it. Raises :class:`ApiError` (400)."""
    body: CompletionBody = structure(raw, CompletionBody)
    n = body.n or 1
    _check_best_of(body.best_of, n)
    if body.suffix is not None:
        raise ApiError(400, "unsupported_value", "suffix is not currently supported", "suffix")
    prompts: tuple[Any, ...] = body.prompt  # type: ignore[assignment]
    if not prompts:
        raise ApiError(400, "invalid_prompt", "prompt must hold at least one prompt", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(
            400,
            "invalid_prompt",
            f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}",
            "prompt",
        )
    if len(prompts) > 1 and body.stream:
        raise ApiError(
            400,
            "unsupported_value",
            f"a stream takes one prompt: {len(prompts)} prompts are answered in one body "
            "(stream: false)",
            "stream",
        )
    tok = tokenizer if tokenizer is not None else BYTE_TOKENIZER
    max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
    return tuple(
        _completion(body, prompt, i * n, max_tokens, tok, hashing)
        for i, prompt in enumerate(prompts)
    )


def parse_completion_request(
    raw: dict[str, Any],
    default_max_tokens: int,
    *,
    tokenizer: Tokenizer | None = None,
    hashing: PromptHashing | None = None,
) -> ParsedRequest:
    """:func:`parse_completion_requests` of a body holding exactly one prompt."""
    parsed = parse_completion_requests(
        raw, default_max_tokens, tokenizer=tokenizer, hashing=hashing
    )
    if len(parsed) != 1:
        raise ApiError(
            400, "invalid_prompt", f"expected exactly 1 prompt, got {len(parsed)}", "prompt"
        )
    return parsed[0]


def _completion(
    body: CompletionBody,
    prompt: str | tuple[int, ...],
    index_base: int,
    max_tokens: int,
    tok: Tokenizer,
    hashing: PromptHashing | None,
) -> ParsedRequest:
    """The request of one prompt of a completions body."""
    stop = _stop_fields(body.stop, max_tokens)
    hashed: dict[str, Any] = {}
    if hashing is not None:
        answer, answer_tokens = hashing.answer(
            max_tokens, stop.get("stop_after"), stop.get("stop_chars")
        )
        if isinstance(prompt, str):
            result = hash_text(tok, prompt, answer, answer_tokens, hashing)
        else:
            result = hash_token_ids(tok, prompt, answer, answer_tokens, hashing)
        hashed = {"block_hashes": result.hashes, "hashed_tokens": result.tokens}
    if isinstance(prompt, str):
        tokens = tok.count(prompt) if hashing is None else result.count
        echo_text = prompt
    else:
        tokens = len(prompt)
        if tok.exact:
            try:
                echo_text = tok.decode(prompt)
            except ValueError as exc:
                raise invalid_value("prompt", f"prompt: {exc}") from None
        else:  # the byte rule gives token ids no text: they echo as placeholder words
            echo_text = _token_echo(prompt)
    echo_tokens: tuple[str, ...] = ()
    if body.echo and body.logprobs is not None:  # the prompt's own logprobs
        echo_tokens = prompt_token_texts(tok, prompt)
    stream = bool(body.stream)
    return ParsedRequest(
        kind="completions",
        model=body.model,
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_include_usage(stream, body.stream_options),
        priority=body.priority or 0,
        echo_text=echo_text if body.echo else "",
        n=body.n or 1,
        logprobs=body.logprobs,
        echo_tokens=echo_tokens,
        index_base=index_base,
        session=session_key(body.prompt_cache_key, body.user),
        **stop,
        **hashed,
        **_length_fields(body.ignore_eos, body.min_tokens, max_tokens),
    )


@attrs.frozen(kw_only=True)
class CapacityRequest:
    """A ``POST /control/capacity`` body: every key optional, no other key allowed;
    ``model`` None addresses every model. Both limits are at most :data:`MAX_CAPACITY`."""

    model: str | None = None
    max_num_seqs: int | None = attrs.field(default=None, validator=in_range(1, MAX_CAPACITY))
    max_waiting: int | None = attrs.field(default=None, validator=in_range(0, MAX_CAPACITY))


def parse_capacity_request(raw: dict[str, Any]) -> CapacityRequest:
    """Validate a capacity change; raises :class:`ApiError` 400 ``invalid_value`` naming
    the field (a bool is not an integer; unknown keys are errors; bounds as documented on
    :class:`CapacityRequest`)."""
    result: CapacityRequest = structure(raw, CapacityRequest, strict=True)
    return result
