"""The two completion routes, served straight on ASGI messages.

``POST /v1/chat/completions`` and ``POST /v1/completions`` carry nearly all of a busy
server's traffic, so they skip Quart's request and response objects: the app's ASGI
connection (:mod:`inference_lab.serve.asgi`) calls :func:`complete` with the raw scope,
``receive`` and ``send``. Every other endpoint is an ordinary Quart route.

Rule 1: checks run in the order body (413/408/400) -> validation (400) -> model (404) -> fit
        (400) -> a decode server's claim on its prefill's KV (400/404/503:
        :mod:`inference_lab.serve.kv_transfer`) -> engine alive (503) -> depth (529); the
        last two are one synchronous call, ``ModelRuntime.admit_nowait``, and every refusal
        is a whole :class:`Reply` sent before any response starts. Between model and fit
        the test harness may take the request over (:mod:`inference_lab.serve.harness`).
Rule 2: a request's arrival is the exchange's (``Exchange.arrival``: when the server
        received it, :func:`inference_lab.serve.transport.received_at`), before its body
        was read and parsed, as a real engine's API server stamps it.
        Its body must be whole by the arrival plus ``body_timeout`` (else 408): only a
        wait for a piece is bounded by that deadline, so a body that came with its
        headers (the usual case) costs no cancel scope
        (:func:`inference_lab.serve.request_body.read_body`, importable from here).
Rule 3: an admitted request is closed (aborted unless it finished) exactly when its
        exchange ends, whatever ends it: the ``finally`` here is synchronous and
        idempotent, and a client that leaves wakes the writer or collector at once.
Rule 4: a client that leaves is noticed by its connection where the transport offers a
        close watch, otherwise by a task per request waiting for the ``http.disconnect``
        message (:func:`inference_lab.serve.client_gone.while_watched`).
Rule 5: what one request may ask for is bounded at parse time
        (``api.requests.MAX_RESPONSE_WORK``: n x max_tokens x (1 + logprobs)).
Rule 6: a non-streaming body larger than ``LARGE_BODY`` token entries is sent in pieces
        of bounded work (``api.encoding.body_pieces``), with a checkpoint between pieces.
Rule 7: a chat request whose answer is tool calls, structured output or reasoning
        (``serve.agents.chat_plan``) is served from the harness's place on by
        :func:`inference_lab.serve.agents.serve_chat_agent`, under the same contract; a
        completions request asking for structured output is a 400.
Rule 8: a completions body of several prompts is an engine request per prompt, admitted
        whole or not at all (:func:`serve_batch`; not streamed), and answered with every
        prompt's choices once all finished (:mod:`inference_lab.api.completion_batch`).
        ``max_tokens: 0`` scores the prompt: one prefill step, whose token is not
        reported (``completion_tokens`` 0, ``finish_reason: length``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import attrs
import trio

from inference_lab.api.completion_batch import PromptResult, batch_pieces
from inference_lab.api.encoding import (
    PIECE_TOKENS,
    StreamEncoder,
    body_pieces,
    body_work,
    completion_body,
    new_request_id,
)
from inference_lab.api.requests import (
    MAX_RESPONSE_WORK,
    ParsedRequest,
    check_work,
    parse_chat_request,
    parse_completion_requests,
)
from inference_lab.api.schema import parse_json_object
from inference_lab.errors import ApiError, EngineUnavailable, QueueFull
from inference_lab.runtime.model_runtime import ModelRuntime, RequestHandle
from inference_lab.serve.agents import (
    chat_plan,
    reasoning_keys,
    refuse_structured,
    serve_chat_agent,
)
from inference_lab.serve.client_gone import while_watched
from inference_lab.serve.error_replies import (
    JSON,
    STREAM_HEADERS,
    Reply,
    error_reply,
    send_reply,
    shutting_down_reply,
    stream_shutdown_frames,
)
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.kv_transfer import KVRequest
from inference_lab.serve.request_body import (
    MAX_BODY_PIECES,
    BodyRefused,
    BodyTimeout,
    BodyTooFragmented,
    BodyTooLarge,
    ClientGone,
    body_refusal,
    read_body,
)
from inference_lab.serve.request_body import _receive_nowait as _receive_nowait
from inference_lab.serve.state import ServeState
from inference_lab.serve.streaming import CollectSink, StreamSink, write_stream

__all__ = [
    "COMPLETION_ROUTES",
    "MAX_BODY_PIECES",
    "BodyTimeout",
    "BodyTooFragmented",
    "BodyTooLarge",
    "ClientGone",
    "check_fit",
    "complete",
    "parse_body",
    "read_body",
]

Kind = Literal["chat", "completions"]

#: Path -> kind of the routes :func:`complete` serves (POST only).
COMPLETION_ROUTES: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}


class ServedStreamSink(StreamSink):
    """A stream's sink that knows its server: when a shutdown stopped the runtimes, the
    stream's error frame names the shutdown rather than a stopped engine."""

    __slots__ = ("state",)

    def __init__(self, encoder: StreamEncoder, state: ServeState) -> None:
        super().__init__(encoder)
        self.state = state

    def on_failed(self, message: str) -> None:
        if self.state.shutdown_message is None:
            super().on_failed(message)
        else:
            self.closing = stream_shutdown_frames()
            self._end()


class ScoringStreamEncoder(StreamEncoder):
    """The stream of a ``max_tokens: 0`` request (Rule 8): the echo (with the prompt's
    logprobs) and the closing frames; the prefill step's token is not sent or counted."""

    __slots__ = ()

    def tokens(self, start: int, stop: int, *, final: bool = False) -> bytes:
        return b""

    def closing(self, finish_reason: str, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        return super().closing(finish_reason, 0, cached_tokens)


def _gone(handle: RequestHandle, sink: StreamSink | CollectSink) -> None:
    """The client left: abort the request and wake its writer."""
    handle.close()
    sink.on_gone()


async def complete(
    state: ServeState, kind: Kind, exchange: Exchange, receive: Receive, send: Send
) -> None:
    """Serve one completion request (see the module rules). Called by the app's ASGI
    connection for ``POST`` on a path of :data:`COMPLETION_ROUTES`."""
    handle: RequestHandle | None = None
    kv: KVRequest | None = None
    try:
        timeout = state.settings.body_timeout
        try:
            body = await read_body(receive, exchange.scope, deadline=exchange.arrival + timeout)
        except ClientGone:
            return
        except BodyRefused as refused:
            await send_reply(send, body_refusal(refused, timeout), exchange.headers)
            return
        try:
            raw, batch = parse_body(state, kind, body)
            parsed = batch[0]
            kv = state.kv.request(raw, batch)  # kv_transfer_params, by --role
            runtime = _runtime(state, parsed.model)
            exchange.note_pacing_lag(runtime.pacing_lag())  # on every answer from here
            if len(batch) > 1:  # several prompts: answered whole (Rule 8)
                state.harness.intercept(exchange, raw, parsed)  # (a fault header: its 400)
                await serve_batch(state, runtime, exchange, receive, send, batch)
                return
            # The test harness (fault header, scripted marker, [fault] table) answers
            # here; a fault that bypasses the engine skips fit and depth (no 529).
            harnessed = state.harness.intercept(exchange, raw, parsed)
            if harnessed is not None:
                await harnessed.serve(state, runtime, exchange, receive, send)
                return
            # Tools, structured output, reasoning: the answer's content is planned (400s
            # here) and served by serve/agents.py; a plain answer stays on this path.
            plan = None
            if kind == "chat":
                plan = await chat_plan(state, runtime, raw, parsed, len(body))
            else:
                refuse_structured(raw)
            if plan is not None:
                keys = reasoning_keys(state, raw)
                await serve_chat_agent(
                    state, runtime, exchange, receive, send, parsed, plan, keys, kv=kv
                )
                return
            engine_prompt = check_fit(runtime, parsed)
            if state.draining:  # the shutdown began while this body was read
                await send_reply(send, shutting_down_reply(), exchange.headers)
                return
            if kv is not None:  # a decode server's claim on its prefill's KV (Rule 1)
                await kv.begin(runtime, engine_prompt, exchange.scope)
            request_id = exchange.request_id or new_request_id(parsed.kind)
            created = int(time.time())
            sink = _sink(state, runtime, parsed, kv, request_id, created)
            handle = _admit(runtime, exchange, parsed, kv, engine_prompt, sink)
            _admitted(state, parsed, kv, sink, handle)
        except (ApiError, QueueFull, EngineUnavailable) as exc:
            reply = error_reply(exc, should_retry_header=state.settings.should_retry_header)
            await send_reply(send, reply, exchange.headers)
            return
        admitted, collector = handle, sink
        await while_watched(
            send,
            receive,
            lambda: _gone(admitted, collector),  # Rule 4
            lambda: _respond(
                state, exchange, send, admitted, collector, parsed, request_id, created, kv
            ),
        )
    finally:
        if handle is not None:
            handle.close()
        if kv is not None:
            kv.close()


def parse_body(
    state: ServeState, kind: Kind, body: bytes
) -> tuple[dict[str, Any], tuple[ParsedRequest, ...]]:
    """The body as JSON and the request(s) it makes (a completions body may hold several
    prompts: Rule 8), counted with the model's tokenizer and hashed for its prefix cache;
    raises ApiError (400)."""
    raw = parse_json_object(body)
    # the model's tokenizer counts the prompt (validation still answers first)
    model = state.counted_as(raw.get("model"))  # an adapter's: its base's
    tokenizer = state.settings.tokenizers.get(model) if type(model) is str else None
    hashing = state.hashing.get(model) if type(model) is str else None  # prefix caching
    default_max_tokens = state.settings.default_max_tokens
    if kind == "chat":
        parsed = parse_chat_request(raw, default_max_tokens, tokenizer=tokenizer, hashing=hashing)
        return raw, (parsed,)
    batch = parse_completion_requests(raw, default_max_tokens, tokenizer=tokenizer, hashing=hashing)
    return raw, batch


def _runtime(state: ServeState, model: str) -> ModelRuntime:
    """The runtime serving ``model`` (a model, or a LoRA adapter's); 404 when none does."""
    runtime = state.runtime_for(model)
    if runtime is None:
        raise state.model_not_found(model)
    return runtime


def check_fit(runtime: ModelRuntime, parsed: ParsedRequest) -> int:
    """The prompt's length in the engine (at least 1) once the request fits the model
    (400 ``context_length_exceeded`` otherwise) and its work is bounded (Rule 5)."""
    engine_prompt = max(1, parsed.prompt_tokens)
    refused = runtime.check_fits(engine_prompt, parsed.engine_max_tokens, parsed.n)
    if refused is not None:
        raise ApiError(400, "context_length_exceeded", refused.reason, "max_tokens")
    check_work(parsed)
    return engine_prompt


def _sink(
    state: ServeState,
    runtime: ModelRuntime,
    parsed: ParsedRequest,
    kv: KVRequest | None,
    request_id: str,
    created: int,
) -> StreamSink | CollectSink:
    """Where the engine hands the request's tokens: a stream's encoder and writer, or a
    collector of the whole answer (a prefill server's, with ``kv``)."""
    if parsed.stream:
        scoring = parsed.max_tokens == 0  # the prompt's prefill alone (Rule 8)
        encoder_class = ScoringStreamEncoder if scoring else StreamEncoder
        encoder = encoder_class(
            parsed,
            request_id=request_id,
            created=created,
            multi_token=runtime.deployment.speculative is not None,
        )
        return ServedStreamSink(encoder, state)
    return CollectSink() if kv is None else kv.sink(runtime, request_id)


def _admit(
    runtime: ModelRuntime,
    exchange: Exchange,
    parsed: ParsedRequest,
    kv: KVRequest | None,
    engine_prompt: int,
    sink: StreamSink | CollectSink,
) -> RequestHandle:
    """Admit the request into its engine (``ModelRuntime.admit_nowait``: 503 or 529 when
    refused), stamped with the exchange's arrival (Rule 2)."""
    scoring = parsed.max_tokens == 0  # the prompt's prefill alone (Rule 8)
    return runtime.admit_nowait(
        prompt_tokens=engine_prompt,
        max_tokens=parsed.engine_max_tokens,
        priority=parsed.priority,
        sink=sink,
        arrival=exchange.arrival,
        n=parsed.n,
        limit=1 if scoring else parsed.output_cap,
        block_hashes=parsed.block_hashes,
        drawn=not (parsed.ignore_eos or scoring),
        min_length=parsed.min_tokens,
        model=parsed.model,
        session=parsed.session,
        **(kv.admission() if kv is not None else {}),
    )


def _admitted(
    state: ServeState,
    parsed: ParsedRequest,
    kv: KVRequest | None,
    sink: StreamSink | CollectSink,
    handle: RequestHandle,
) -> None:
    """Right after admission: a decode request's pull is bound to its handle, the
    KV-events publisher keeps the prompt's tokens, and a stream learns its length."""
    if kv is not None:
        kv.bind(handle)
    if parsed.hashed_tokens is not None:  # the KV-events publisher names blocks' tokens
        state.remember_tokens(parsed)
    if isinstance(sink, StreamSink):
        sink.last = handle.length  # below it, tokens are mid-stream (streaming Rule 7)


#: Token entries (:func:`body_work`) above which a non-streaming body is sent in pieces
#: (Rule 6) rather than built whole.
LARGE_BODY = 8 * PIECE_TOKENS


async def _send_in_pieces(send: Send, exchange: Exchange, pieces: Iterator[bytes]) -> None:
    """Send a 200 JSON body piece by piece (chunked framing), yielding to other tasks
    between pieces: building a piece is bounded work (``PIECE_TOKENS``), so the event loop
    is never held up by one large answer. A client that leaves ends it."""
    headers = [(b"content-type", JSON), *exchange.headers]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for piece in pieces:
        await send({"type": "http.response.body", "body": piece, "more_body": True})
        await trio.lowlevel.checkpoint()
    with trio.CancelScope(shield=True):
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _respond(
    state: ServeState,
    exchange: Exchange,
    send: Send,
    handle: RequestHandle,
    sink: StreamSink | CollectSink,
    parsed: ParsedRequest,
    request_id: str,
    created: int,
    kv: KVRequest | None = None,
) -> None:
    """Answer an admitted request: write its stream, or its whole reply once it ended (a
    prefill server's with its ``kv_transfer_params``: ``kv``)."""
    if isinstance(sink, StreamSink):
        if not handle.alone:  # (an idle engine: when it takes this one moves none of its steps)
            await handle.wait_taken()  # the engine first, then the response's start
        headers = [*STREAM_HEADERS, *exchange.headers]
        start = {"type": "http.response.start", "status": 200, "headers": headers}
        sink.encoder.prepare()  # while the prefill runs, not at its first token
        if sink.pending() or state.delivery.interval > 0:
            # with its first frames, in one write (streaming Rule 5)
            await write_stream(send, sink, state.delivery, start)
        else:
            await send(start)
            await write_stream(send, sink, state.delivery)
    else:
        await sink.event.wait()
        handle.close()
        finished = sink.finished
        if finished is not None and parsed.max_tokens == 0:  # scored: no answer token
            finished = attrs.evolve(finished, output_tokens=0)
        if finished is not None and body_work(parsed, finished.output_tokens) > LARGE_BODY:
            pieces = body_pieces(
                parsed,
                request_id=request_id,
                created=created,
                completion_tokens=finished.output_tokens,
                finish_reason=finished.finish_reason,
                cached_tokens=finished.cached_tokens,
            )
            await _send_in_pieces(send, exchange, pieces if kv is None else kv.pieces(pieces))
            if kv is not None:
                kv.delivered = not sink.gone
            return
        if finished is not None:
            body = completion_body(
                parsed,
                request_id=request_id,
                created=created,
                completion_tokens=finished.output_tokens,
                finish_reason=finished.finish_reason,
                cached_tokens=finished.cached_tokens,
            )
            reply = Reply(200, body if kv is None else kv.body(body))
        else:
            unfinished = sink.unfinished_reply(state.shutdown_message)
            if unfinished is None:
                return
            reply = unfinished
        with trio.CancelScope(shield=True):
            await send_reply(send, reply, exchange.headers)
        if kv is not None:
            kv.delivered = reply.status == 200 and not sink.gone


def _batch_work(requests: Sequence[ParsedRequest]) -> None:
    """A 400 when a batch asks for more than :data:`MAX_RESPONSE_WORK` token entries in
    all (Rule 5, summed over its prompts)."""
    work = 0
    for request in requests:
        echo = request.prompt_tokens if request.echo_text else 0
        work += request.n * (request.max_tokens + echo) * (1 + (request.logprobs or 0))
    if work > MAX_RESPONSE_WORK:
        raise ApiError(
            400,
            "invalid_value",
            f"{len(requests)} prompts ask for {work:,} token entries in all, more than this "
            f"server's {MAX_RESPONSE_WORK:,} per request: send fewer prompts or lower max_tokens",
            "prompt",
        )


class _Batch:
    """The sinks and handles of a batch's prompts: done when all finished, or when one
    failed or the client left."""

    def __init__(self, count: int) -> None:
        self.sinks = [CollectSink() for _ in range(count)]
        self.handles: list[RequestHandle] = []

    def gone(self) -> None:
        self.close()
        for sink in self.sinks:
            sink.on_gone()

    async def wait(self) -> None:
        for sink in self.sinks:
            await sink.event.wait()
            if sink.finished is None:
                return

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


async def serve_batch(
    state: ServeState,
    runtime: ModelRuntime,
    exchange: Exchange,
    receive: Receive,
    send: Send,
    requests: Sequence[ParsedRequest],
) -> None:
    """A completions body of several prompts (Rule 8). Raises :class:`ApiError`,
    ``QueueFull`` or ``EngineUnavailable`` only before anything is sent."""
    for i, request in enumerate(requests):
        refused = runtime.check_fits(
            max(1, request.prompt_tokens), request.engine_max_tokens, request.n
        )
        if refused is not None:
            raise ApiError(
                400, "context_length_exceeded", f"prompt[{i}]: {refused.reason}", "prompt"
            )
    _batch_work(requests)
    if state.draining:
        await send_reply(send, shutting_down_reply(), exchange.headers)
        return
    batch = _Batch(len(requests))
    try:
        for request, sink in zip(requests, batch.sinks, strict=True):
            prompt = max(1, request.prompt_tokens)
            batch.handles.append(_admit(runtime, exchange, request, None, prompt, sink))
            if request.hashed_tokens is not None:
                state.remember_tokens(request)
    except (QueueFull, EngineUnavailable):
        for handle in batch.handles:
            handle.withdraw()  # all or none
        raise
    try:
        await while_watched(send, receive, batch.gone, batch.wait)
        batch.close()
        await _answer_batch(state, exchange, send, requests, batch)
    finally:
        batch.close()


async def _answer_batch(
    state: ServeState,
    exchange: Exchange,
    send: Send,
    requests: Sequence[ParsedRequest],
    batch: _Batch,
) -> None:
    failed = next((s for s in batch.sinks if s.finished is None), None)
    if failed is not None:
        reply = failed.unfinished_reply(state.shutdown_message)
        if reply is not None:
            with trio.CancelScope(shield=True):
                await send_reply(send, reply, exchange.headers)
        return
    results = [
        PromptResult(
            completion_tokens=0 if request.max_tokens == 0 else sink.finished.output_tokens,
            finish_reason=sink.finished.finish_reason,
            cached_tokens=sink.finished.cached_tokens,
        )
        for request, sink in zip(requests, batch.sinks, strict=True)
        if sink.finished is not None
    ]
    request_id = exchange.request_id if exchange.request_id.startswith("cmpl-") else ""
    pieces = batch_pieces(
        requests,
        results,
        request_id=request_id or new_request_id("completions"),
        created=int(time.time()),
    )
    work = sum(body_work(r, x.completion_tokens) for r, x in zip(requests, results, strict=True))
    if work > LARGE_BODY:
        await _send_in_pieces(send, exchange, pieces)
        return
    with trio.CancelScope(shield=True):
        await send_reply(send, Reply(200, b"".join(pieces)), exchange.headers)
