"""Response bytes: ids, usage, non-streaming bodies and the SSE frames of a stream.

Rule 1: stream frames are built from bytes encoded once per request (one frame per
        placeholder word and choice), so a token costs a list index, not a
        ``json.dumps`` (a completions ``text_offset`` costs one ``int`` to text).
Rule 2: a stream sends one frame per token and choice; its texts concatenate to the
        non-streaming text, whether or not a stop string cut it. A multi-token encoder
        (a speculative model's: ``docs/serve.md``) sends one frame per choice for every
        run of tokens written together -- a step's tokens, as vLLM sends a step's output
        as one delta -- whose text and logprobs are those of its tokens' frames joined.
Rule 3: every JSON body is compact (:mod:`inference_lab.jsonbytes`), keeps OpenAI's key
        order and never fails to encode.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from typing import Any, Literal

from inference_lab.api.prompt_logprobs import (
    prompt_field,
    prompt_logprobs,
    with_prompt_logprobs,
)
from inference_lab.api.requests import ParsedRequest
from inference_lab.api.text import (
    VOCABULARY,
    WORDS,
    chat_logprob_entry,
    chat_logprobs,
    completion_logprobs,
    completion_top_logprobs,
    placeholder_text,
    token_start,
    tokens_ending_by,
)
from inference_lab.errors import error_body
from inference_lab.jsonbytes import dumps, dumps_str

__all__ = [
    "DONE_FRAME",
    "PIECE_TOKENS",
    "StreamEncoder",
    "body_pieces",
    "body_work",
    "choices_pieces",
    "completion_body",
    "new_request_id",
    "random_hex",
    "usage",
]


def random_hex() -> str:
    """32 random hex digits (128 bits), as ``uuid.uuid4().hex`` but cheaper: request ids
    need only be unique, not secret, so they come from ``random``'s generator (seeded
    from the OS, and again in a forked child) rather than from a read of the OS's random
    source each time."""
    return f"{random.getrandbits(128):032x}"


def new_request_id(kind: Literal["chat", "completions"]) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{random_hex()}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A response's ``usage``, with OpenAI's ``prompt_tokens_details.cached_tokens``: the
    prompt tokens the engine found in its prefix cache (``Finished.cached_tokens``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


#: Tokens of logprobs encoded per piece of a body sent in pieces (:func:`body_pieces`):
#: each piece costs the event loop well under a millisecond to build.
PIECE_TOKENS = 2048
#: Echoed prompt tokens per piece of a body (a prompt token's entry costs more).
PROMPT_PIECE_TOKENS = 256
#: A logprobs value in a body's dict, replaced by the logprobs' pieces.
_LOGPROBS_SLOT = "\x00logprobs\x00"


def _body_head(
    request: ParsedRequest,
    *,
    request_id: str,
    created: int,
    completion_tokens: int,
    finish_reason: str,
    logprobs: Any,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """The non-streaming body as a dict, each choice's ``logprobs`` (when asked for) being
    ``logprobs``."""
    text = request.output_text(completion_tokens)
    reason = request.finish_reason(finish_reason, completion_tokens)
    head: dict[str, Any] = {"id": request_id}
    choices: list[dict[str, Any]] = []
    if request.kind == "chat":
        head["object"] = "chat.completion"
        for index in range(request.n):
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text},
            }
            if request.logprobs is not None:
                choice["logprobs"] = logprobs
            choice["finish_reason"] = reason
            choices.append(choice)
    else:
        head["object"] = "text_completion"
        for index in range(request.n):
            choice = {"text": request.echo_text + text, "index": request.index_base + index}
            if request.logprobs is not None:
                choice["logprobs"] = logprobs
            choice["finish_reason"] = reason
            choices.append(choice)
    head["created"] = created
    head["model"] = request.model
    head["choices"] = choices
    head["usage"] = usage(request.prompt_tokens, completion_tokens * request.n, cached_tokens)
    return head


def completion_body(
    request: ParsedRequest,
    *,
    request_id: str,
    created: int,
    completion_tokens: int,
    finish_reason: str,
    cached_tokens: int = 0,
) -> bytes:
    """The non-streaming response body. ``completion_tokens``, ``finish_reason`` and
    ``cached_tokens`` are the engine's ``Finished``; there are ``request.n`` identical
    choices and usage counts ``n * completion_tokens``. The text is :meth:`ParsedRequest.output_text`
    and the finish reason :meth:`ParsedRequest.finish_reason`."""
    logprobs: dict[str, Any] | None = None
    if request.logprobs is not None:
        if request.kind == "chat":
            logprobs = chat_logprobs(completion_tokens, request.logprobs)
        else:
            logprobs = completion_logprobs(
                completion_tokens, request.logprobs, len(request.echo_text)
            )
            if request.echo_tokens:  # the prompt's own logprobs come first
                logprobs = with_prompt_logprobs(request.echo_tokens, request.logprobs, logprobs)
    return dumps(
        _body_head(
            request,
            request_id=request_id,
            created=created,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            logprobs=logprobs,
            cached_tokens=cached_tokens,
        )
    )


def body_work(request: ParsedRequest, completion_tokens: int) -> int:
    """Token entries a non-streaming body holds: each choice's tokens (the echoed prompt
    too), each with its logprobs alternatives."""
    echo = request.prompt_tokens if request.echo_text else 0
    return request.n * (completion_tokens + echo) * (1 + (request.logprobs or 0))


def _chat_logprobs_pieces(count: int, top: int) -> Iterator[bytes]:
    entries = [dumps(chat_logprob_entry(w, top)) for w in range(len(WORDS))]
    yield b'{"content":['
    for start in range(0, count, PIECE_TOKENS):
        stop = min(count, start + PIECE_TOKENS)
        part = b",".join(entries[i % len(entries)] for i in range(start, stop))
        yield part if start == 0 else b"," + part
    yield b"]}"


def _completion_logprobs_pieces(
    count: int, top: int, offset: int, echo_tokens: tuple[str, ...] = ()
) -> Iterator[bytes]:
    """A completions choice's ``logprobs`` in pieces of :data:`PIECE_TOKENS` entries: the
    prompt's entries first (``echo_tokens``), then the answer's ``count``."""
    n = len(WORDS)
    words = [dumps(w) for w in WORDS]
    tops = [dumps(completion_top_logprobs(w, top)) for w in range(n)]
    arrays: list[tuple[bytes, Any, int]] = [
        (b'{"tokens":[', lambda i: words[i % n], 0),
        (b'],"token_logprobs":[', lambda i: b"-0.25", 1),
        (b'],"top_logprobs":[', lambda i: tops[i % n], 2),
        (b'],"text_offset":[', lambda i: str(offset + token_start(i)).encode(), 3),
    ]
    prompt = len(echo_tokens)
    for opening, item, field in arrays:
        yield opening
        for start in range(0, prompt, PROMPT_PIECE_TOKENS):
            stop = min(prompt, start + PROMPT_PIECE_TOKENS)
            part = prompt_field(echo_tokens, top, field, start, stop)
            yield part if start == 0 else b"," + part
        for start in range(0, count, PIECE_TOKENS):
            stop = min(count, start + PIECE_TOKENS)
            part = b",".join(item(i) for i in range(start, stop))
            yield part if start == 0 and not prompt else b"," + part
    yield b"]}"


def body_pieces(
    request: ParsedRequest,
    *,
    request_id: str,
    created: int,
    completion_tokens: int,
    finish_reason: str,
    cached_tokens: int = 0,
) -> Iterator[bytes]:
    """:func:`completion_body` in pieces, each holding at most :data:`PIECE_TOKENS`
    tokens' logprobs, so a large body never holds up its sender for long: the pieces
    concatenate to exactly :func:`completion_body`'s bytes."""
    head = _body_head(
        request,
        request_id=request_id,
        created=created,
        completion_tokens=completion_tokens,
        finish_reason=finish_reason,
        logprobs=_LOGPROBS_SLOT,
        cached_tokens=cached_tokens,
    )
    yield from _filled(request, dumps(head), completion_tokens)


def _filled(request: ParsedRequest, encoded: bytes, completion_tokens: int) -> Iterator[bytes]:
    """``encoded`` (a body or its choices) with each logprobs slot filled in pieces."""
    if request.logprobs is None:
        yield encoded
        return
    slot = dumps(_LOGPROBS_SLOT)
    parts = encoded.split(slot)
    for i, part in enumerate(parts):
        yield part
        if i < len(parts) - 1:
            if request.kind == "chat":
                yield from _chat_logprobs_pieces(completion_tokens, request.logprobs)
            else:
                yield from _completion_logprobs_pieces(
                    completion_tokens,
                    request.logprobs,
                    len(request.echo_text),
                    request.echo_tokens,
                )


def choices_pieces(
    request: ParsedRequest, *, completion_tokens: int, finish_reason: str
) -> Iterator[bytes]:
    """The choices of ``request`` as :func:`body_pieces` writes them, without the array's
    brackets: one prompt's share of a batch body
    (:mod:`inference_lab.api.completion_batch`)."""
    head = _body_head(
        request,
        request_id="",
        created=0,
        completion_tokens=completion_tokens,
        finish_reason=finish_reason,
        logprobs=_LOGPROBS_SLOT,
    )
    encoded = dumps(head)
    start = encoded.index(b'"choices":[') + len(b'"choices":[')
    yield from _filled(request, encoded[start : encoded.rindex(b'],"usage":')], completion_tokens)


DONE_FRAME = b"data: [DONE]\n\n"


def _text_tail(kind: str, index: int, text: str) -> bytes:
    """What follows a stream frame's head in a frame of choice ``index`` carrying ``text``
    and no logprobs."""
    if kind == "chat":
        return b'"choices":[{"index":%d,"delta":{"content":' % index + dumps(text) + b"}}]}\n\n"
    return b'"choices":[{"text":' + dumps(text) + b',"index":%d}]}\n\n' % index


@functools.cache
def _plain_tails(kind: str) -> tuple[bytes, ...]:
    """The tails of choice 0's frames of the placeholder words, in word order (built once
    per kind)."""
    return tuple(_text_tail(kind, 0, word) for word in WORDS)


#: A token frame: complete bytes, or (bytes before, bytes after) a completions
#: ``text_offset`` that depends on the token's position.
_Frame = bytes | tuple[bytes, bytes]


class StreamEncoder:
    """Pre-encoded SSE frames of one streaming response.

    Built once per request; the distinct token frames (one per placeholder word and
    choice) are built on the first token, so a run of tokens costs one index per token
    and choice (:meth:`tokens`). Tokens from the one a stop string cuts onwards have
    their own frames, built with the rest.
    """

    __slots__ = (
        "_head",
        "_request",
        "_frames",
        "_special",
        "_cut",
        "_plain",
        "_plain_until",
        "_last",
        "_multi",
        "_entries",
    )

    def __init__(
        self,
        request: ParsedRequest,
        *,
        request_id: str,
        created: int,
        multi_token: bool = False,
    ) -> None:
        self._request = request
        #: one frame per choice for each run of tokens written together (Rule 2)
        self._multi = multi_token
        #: the encoded logprobs entry of each word (multi-token frames, built once)
        self._entries: tuple[bytes, ...] | None = None
        obj = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
        self._head = (
            f'data: {{"id":{dumps_str(request_id)},"object":"{obj}","created":{created},'
            f'"model":{dumps_str(request.model)},'
        ).encode("utf-8", "backslashreplace")
        self._frames: tuple[tuple[_Frame, ...], ...] | None = None
        self._special: dict[int, tuple[_Frame, ...]] = {}
        #: the token (0-based) in which the stop cut falls; None without a stop
        self._cut: int | None = None
        if request.stop_after is not None and request.stop_chars is not None:
            self._cut = tokens_ending_by(request.stop_chars)
        #: one choice without logprobs: the 50 complete frames (set with the frames),
        #: good for the tokens before ``_plain_until`` (the stop cut)
        self._plain: tuple[bytes, ...] | None = None
        self._plain_until = self._cut if self._cut is not None else 1 << 62
        #: word -> the frames of a stream's last token (no trailing space)
        self._last: dict[int, tuple[_Frame, ...]] = {}

    # -- frame building ------------------------------------------------------------
    def _text_frame(self, index: int, text: str) -> bytes:
        """A frame of choice ``index`` carrying ``text`` and no logprobs."""
        return self._head + _text_tail(self._request.kind, index, text)

    def _frame(self, index: int, text: str, word: int) -> _Frame:
        """The frame of one token of choice ``index`` carrying ``text`` and, when asked
        for, the logprobs of a token emitting ``VOCABULARY[word]``."""
        request = self._request
        top = request.logprobs
        if top is None:
            return self._text_frame(index, text)
        if request.kind == "chat":
            head = self._head + b'"choices":[{"index":%d,"delta":{"content":' % index
            entry = dumps(chat_logprob_entry(word, top))
            return head + dumps(text) + b'},"logprobs":{"content":[' + entry + b"]}}]}\n\n"
        body = self._head + b'"choices":[{"text":' + dumps(text) + b',"index":%d' % index
        token = WORDS[word]
        body += (
            b',"logprobs":{"tokens":['
            + dumps(token)
            + b'],"token_logprobs":[-0.25],"top_logprobs":['
            + dumps(completion_top_logprobs(word, top))
            + b'],"text_offset":['
        )
        return body, b"]}}]}\n\n"

    def prepare(self) -> None:
        """Build the token frames now rather than on the first token (the completion route
        calls it while the request's prefill runs, off the path of its first token)."""
        self._token_frames()

    def _token_frames(self) -> tuple[tuple[_Frame, ...], ...]:
        frames = self._frames
        if frames is None:
            cut = self._cut
            request = self._request
            if request.n == 1 and request.logprobs is None:
                head = self._head  # the common case: the head + a tail shared by all streams
                self._plain = tuple([head + tail for tail in _plain_tails(request.kind)])
                frames = tuple([(frame,) for frame in self._plain])
            else:
                frames = tuple(
                    tuple(self._frame(c, WORDS[w], w) for c in range(request.n))
                    for w in range(len(WORDS))
                )
            self._frames = frames
            if cut is not None and request.stop_after is not None:
                text = placeholder_text(request.stop_after)
                for i in range(cut, request.stop_after):
                    piece = text[token_start(i) : request.stop_chars] if i == cut else ""
                    w = i % len(WORDS)
                    self._special[i] = tuple(self._frame(c, piece, w) for c in range(request.n))
        return frames

    # -- the frames ----------------------------------------------------------------
    def opening(self) -> bytes:
        """What is sent at admission: the chat role frame of each choice, or each choice's
        completions echo frame (empty for a completions stream without echo)."""
        n = self._request.n
        if self._request.kind == "chat":
            return b"".join(
                self._head + b'"choices":[{"index":%d,"delta":{"role":"assistant"}}]}\n\n' % c
                for c in range(n)
            )
        if self._request.echo_text:
            request = self._request
            text = dumps(request.echo_text)
            tail = b"}]}\n\n"
            if request.echo_tokens and request.logprobs is not None:  # the prompt's logprobs
                logprobs = prompt_logprobs(request.echo_tokens, request.logprobs)
                tail = b',"logprobs":' + dumps(logprobs) + tail
            return b"".join(
                self._head + b'"choices":[{"text":' + text + b',"index":%d' % c + tail
                for c in range(n)
            )
        return b""

    def tokens(self, start: int, stop: int, *, final: bool = False) -> bytes:
        """The frames of tokens ``start .. stop-1`` (each token: one frame per choice, in
        choice order), joined. ``final``: token ``stop-1`` is the stream's last (it
        finished), so its word goes without the trailing space — the streamed text then
        equals the non-streaming text, which client tokenizers count as exactly
        ``completion_tokens`` tokens."""
        if self._multi and stop - start > 1:
            return self._joined(start, stop, final)
        if final and stop > start and (self._cut is None or stop - 1 < self._cut):
            return self.tokens(start, stop - 1) + self._last_frames(stop - 1)
        plain = self._plain
        if plain is not None and stop <= self._plain_until:  # the common case
            return b"".join([plain[i % 50] for i in range(start, stop)])
        frames = self._token_frames()
        size = len(frames)
        request = self._request
        cut = self._cut
        out: list[bytes] = []
        base = len(request.echo_text)
        special = self._special
        for i in range(start, stop):
            row = special.get(i) if cut is not None and i >= cut else None
            if row is None:
                row = frames[i % size]
            for frame in row:
                if isinstance(frame, bytes):
                    out.append(frame)
                else:
                    out.append(frame[0] + b"%d" % (base + token_start(i)) + frame[1])
        return b"".join(out)

    def _joined(self, start: int, stop: int, final: bool) -> bytes:
        """Rule 2's multi-token frames: one per choice carrying tokens ``start .. stop-1``,
        each token's text and logprobs exactly those of its own frame (a stop cut's tail
        and the last word without its space included)."""
        request = self._request
        cut = self._cut
        size = len(WORDS)
        texts: list[str] = []
        for i in range(start, stop):
            if cut is not None and i >= cut:
                if i == cut and request.stop_after is not None:
                    whole = placeholder_text(request.stop_after)
                    texts.append(whole[token_start(i) : request.stop_chars])
                else:
                    texts.append("")
            elif final and i == stop - 1:
                texts.append(VOCABULARY[i % size])
            else:
                texts.append(WORDS[i % size])
        text = dumps("".join(texts))
        top = request.logprobs
        kind = request.kind
        head = self._head
        out: list[bytes] = []
        if top is None:
            for c in range(request.n):
                if kind == "chat":
                    out.append(head + b'"choices":[{"index":%d,"delta":{"content":' % c + text)
                    out.append(b"}}]}\n\n")
                else:
                    out.append(head + b'"choices":[{"text":' + text + b',"index":%d}]}\n\n' % c)
            return b"".join(out)
        words = [i % size for i in range(start, stop)]
        if kind == "chat":
            entries = self._entries
            if entries is None:
                entries = self._entries = tuple(
                    dumps(chat_logprob_entry(w, top)) for w in range(size)
                )
            logprobs = b",".join(entries[w] for w in words)
            for c in range(request.n):
                out.append(head + b'"choices":[{"index":%d,"delta":{"content":' % c + text)
                out.append(b'},"logprobs":{"content":[' + logprobs + b"]}}]}\n\n")
            return b"".join(out)
        base = len(request.echo_text)
        body = (
            b',"logprobs":{"tokens":['
            + b",".join(dumps(WORDS[w]) for w in words)
            + b'],"token_logprobs":['
            + b",".join(b"-0.25" for _ in words)
            + b'],"top_logprobs":['
            + b",".join(dumps(completion_top_logprobs(w, top)) for w in words)
            + b'],"text_offset":['
            + b",".join(b"%d" % (base + token_start(i)) for i in range(start, stop))
            + b"]}}]}\n\n"
        )
        for c in range(request.n):
            out.append(head + b'"choices":[{"text":' + text + b',"index":%d' % c + body)
        return b"".join(out)

    def _last_frames(self, index: int) -> bytes:
        """The frames of token ``index`` as a stream's last token (see :meth:`tokens`)."""
        word = index % len(WORDS)
        row = self._last.get(word)
        if row is None:
            text = VOCABULARY[word]
            row = tuple(self._frame(c, text, word) for c in range(self._request.n))
            self._last[word] = row
        base = len(self._request.echo_text)
        return b"".join(
            frame
            if isinstance(frame, bytes)
            else frame[0] + b"%d" % (base + token_start(index)) + frame[1]
            for frame in row
        )

    def closing(self, finish_reason: str, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The finish frame of each choice, the usage frame when asked for, and ``[DONE]``.

        ``finish_reason``, ``completion_tokens`` and ``cached_tokens`` are the engine's
        ``Finished`` (one choice's tokens): usage counts ``n * completion_tokens``. A stream that a stop string
        would have cut but that ended before the stop string completed first gets the
        text its cut frames held back, so its frames still concatenate to the whole text.
        """
        request = self._request
        n = request.n
        frames = b""
        cut = self._cut
        if cut is not None and not request.stopped(completion_tokens) and completion_tokens > cut:
            held = placeholder_text(completion_tokens)[request.stop_chars :]
            frames += b"".join(self._text_frame(c, held) for c in range(n))
        reason = dumps(request.finish_reason(finish_reason, completion_tokens))
        for c in range(n):
            if request.kind == "chat":
                frames += (
                    self._head
                    + b'"choices":[{"index":%d,"delta":{},"finish_reason":' % c
                    + reason
                    + b"}]}\n\n"
                )
            else:
                frames += (
                    self._head
                    + b'"choices":[{"text":"","index":%d,"finish_reason":' % c
                    + reason
                    + b"}]}\n\n"
                )
        if request.include_usage:
            use = dumps(usage(request.prompt_tokens, completion_tokens * n, cached_tokens))
            frames += self._head + b'"choices":[],"usage":' + use + b"}\n\n"
        return frames + DONE_FRAME

    @staticmethod
    def failure(message: str) -> bytes:
        """The frames ending a stream whose engine failed: the error, then ``[DONE]``."""
        body = error_body(message, "server_error", "engine_failed", None)
        return b"data: " + body + b"\n\n" + DONE_FRAME
