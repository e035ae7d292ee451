"""Serving agent answers: chat completions whose content is tool calls, structured output
or reasoning, and the Responses API's answers (:mod:`inference_lab.serve.agent_routes`).

The chat route (:mod:`inference_lab.serve.completions`) asks :func:`chat_plan` once a
body is validated and its model known; a plain answer (prose, no reasoning) stays on the
route's own path, anything else is served by :func:`serve_chat_agent`. The content comes
from :mod:`inference_lab.api.agents`; only what the engine sees is shared with the plain
path.

Rule 1: the contract before a response starts is the completion routes' (their Rule 1):
        fit (400), the work cap (400), a shutdown (503), engine alive (503), depth (529),
        in that order after validation and the model; every refusal is a whole reply
        raised before anything is sent, through the same ``ModelRuntime.admit_nowait``.
Rule 2: a JSON answer is admitted with ``limit`` its own length and no drawn length
        (``drawn=False``: the document decides it); a prose answer as the plain route
        admits it. Either way the encoder is bound to ``RequestHandle.length`` at once.
Rule 3: an admitted request is closed exactly when its exchange ends, whatever ends it
        (the ``finally`` is synchronous); a client that leaves wakes its writer or
        collector at once, as on the plain path.
Rule 4: a stream is written by :func:`~inference_lab.serve.streaming.write_stream`, so
        pacing, delivery spacing and direct writes are the plain streams'.
Rule 5: an answer carries its prompt's hash chain into the prefix cache (prose: the
        chain of its prompt and answer, as the plain route's; a JSON answer: its prompt's
        whole blocks only, :func:`prompt_chain`), so an agent's next turn finds its
        conversation cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

import trio

from inference_lab.api.agent_encoding import REASONING_KEYS, ChatAgentEncoder, chat_agent_body
from inference_lab.api.agents import (
    AnswerPlan,
    call_id,
    content_rng,
    parse_chat_agent,
    plan_answer,
    reasoning_ratio,
)
from inference_lab.api.encoding import StreamEncoder, new_request_id
from inference_lab.api.requests import ParsedRequest, check_work
from inference_lab.core.engine import Finished
from inference_lab.errors import ApiError
from inference_lab.generate.budget import Budget
from inference_lab.runtime.model_runtime import ModelRuntime, RequestHandle
from inference_lab.serve.client_gone import while_watched
from inference_lab.serve.error_replies import (
    STREAM_HEADERS,
    Reply,
    send_reply,
    shutting_down_reply,
    stream_shutdown_frames,
)
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.generation import INLINE_BODY, plan_off_loop
from inference_lab.serve.kv_transfer import KVRequest
from inference_lab.serve.state import ServeState
from inference_lab.serve.streaming import CollectSink, StreamSink, write_stream

__all__ = [
    "AGENT_KEYS",
    "AnswerSink",
    "FrameEncoder",
    "chat_plan",
    "may_plan",
    "prompt_chain",
    "reasoning_keys",
    "refuse_structured",
    "serve_answer",
    "serve_chat_agent",
]

#: Chat body fields that may change an answer's shape. A body with none of them, for a
#: model that does not reason by default, is a plain answer without looking further.
AGENT_KEYS = (
    "tools",
    "tool_choice",
    "response_format",
    "guided_json",
    "guided_choice",
    "guided_regex",
    "guided_grammar",
    "structured_outputs",
    "reasoning_effort",
    "chat_template_kwargs",
)


class FrameEncoder(Protocol):
    """What a stream sink asks of an encoder (``StreamEncoder``'s interface), plus
    :meth:`bind`, the answer's length once admission drew it."""

    def bind(self, length: int) -> None: ...

    def opening(self) -> bytes: ...

    def prepare(self) -> None: ...

    def tokens(self, start: int, stop: int, *, final: bool = False) -> bytes: ...

    def closing(
        self, finish_reason: str, completion_tokens: int, cached_tokens: int = 0
    ) -> bytes: ...

    def failure(self, message: str) -> bytes: ...


class AnswerSink(StreamSink):
    """The sink of an agent stream: a failure ends it with the encoder's own frames (the
    Responses API's ``error`` event, or the chat error frame), a shutdown with the
    message naming it."""

    __slots__ = ("state", "chat")

    def __init__(self, encoder: FrameEncoder, state: ServeState, *, chat: bool) -> None:
        super().__init__(cast(StreamEncoder, encoder))
        self.state = state
        self.chat = chat

    def on_finished(self, finished: Finished) -> None:
        # The tokens not yet written are encoded before the closing frames: a Responses
        # encoder numbers its events and opens and closes items in the order it is asked.
        rest = b""
        if self.emitted > self.written:
            rest = self.encoder.tokens(self.written, self.emitted, final=True)
            self.written = self.emitted
        self.closing = rest + self.encoder.closing(
            finished.finish_reason, finished.output_tokens, finished.cached_tokens
        )
        self.finished = True
        self._end()

    def on_failed(self, message: str) -> None:
        shutdown = self.state.shutdown_message
        if shutdown is not None and self.chat:
            self.closing = stream_shutdown_frames()
        else:
            self.closing = self.encoder.failure(shutdown or message)
        self._end()


#: Structured-output fields of a chat body that ``/v1/completions`` does not follow.
STRUCTURED_KEYS = (
    "response_format",
    "guided_json",
    "guided_choice",
    "guided_regex",
    "guided_grammar",
    "structured_outputs",
)


def refuse_structured(raw: Mapping[str, Any]) -> None:
    """A ``/v1/completions`` body asking for structured output is a 400 naming the field:
    only chat and the Responses API follow one (an answer that ignored it would be worse
    than a refusal)."""
    for key in STRUCTURED_KEYS:
        if raw.get(key) is not None:
            raise ApiError(
                400,
                "unsupported_value",
                f"{key} is followed on /v1/chat/completions and /v1/responses, not on "
                "/v1/completions",
                key,
            )


def may_plan(runtime: ModelRuntime, raw: Mapping[str, Any]) -> bool:
    """Whether a chat body may need an answer plan (:func:`chat_plan`): it names an agent
    field, or the model reasons by default. False: a plain answer, with no 400 to come
    from planning."""
    reasoning = runtime.deployment.model.reasoning
    if reasoning is not None and reasoning.default_effort != "none":
        return True
    return any(key in raw for key in AGENT_KEYS)


async def chat_plan(
    state: ServeState,
    runtime: ModelRuntime,
    raw: Mapping[str, Any],
    parsed: ParsedRequest,
    size: int = 0,
) -> AnswerPlan | None:
    """The shape of a chat answer, or None for a plain one (the route's own path), decided
    within the work budget (:func:`~inference_lab.serve.generation.plan_off_loop`: on the
    event loop while cheap, else in a worker thread; a body of ``size`` bytes above
    ``INLINE_BODY`` goes to the thread at once). Raises :class:`ApiError` 400 for bad
    agent fields, a schema no instance satisfies or one too expensive to generate."""
    if not may_plan(runtime, raw):
        return None
    reasoning = runtime.deployment.model.reasoning
    settings = state.settings

    def decide(budget: Budget) -> AnswerPlan | None:
        agent = parse_chat_agent(raw)
        ratio = reasoning_ratio(reasoning, agent.effort, agent.thinking)
        if agent.output is None and not agent.tools and ratio is None:
            return None
        if parsed.logprobs is not None and (ratio is not None or not agent.plain):
            raise ApiError(
                400,
                "unsupported_value",
                "logprobs are not available for answers that call tools, follow a "
                "response_format or reason: ask without logprobs (or turn reasoning off: "
                "reasoning_effort 'none')",
                "logprobs",
            )
        if agent.output is None and not agent.tools:
            return AnswerPlan(ratio=ratio)  # prose that reasons: nothing to draw
        return plan_answer(
            agent,
            content_rng(settings.seed or 0, raw),
            reasoning=reasoning,
            tool_call_probability=settings.tool_call_probability,
            n=parsed.n,
            budget=budget,
        )

    return await plan_off_loop(decide, inline=size <= INLINE_BODY)


def reasoning_keys(state: ServeState, raw: Mapping[str, Any]) -> tuple[str, ...]:
    """The fields a chat answer's reasoning goes under: ``reasoning`` and, unless the
    server drops it (``--no-reasoning-content``), ``reasoning_content``; none when the
    request says ``include_reasoning: false`` (vLLM's field; a 400 unless a boolean)."""
    include = raw.get("include_reasoning", True)
    if type(include) is not bool:
        raise ApiError(
            400, "invalid_value", "include_reasoning must be a boolean", "include_reasoning"
        )
    if not include:
        return ()
    return REASONING_KEYS if state.settings.reasoning_content else REASONING_KEYS[:1]


async def serve_chat_agent(
    state: ServeState,
    runtime: ModelRuntime,
    exchange: Exchange,
    receive: Receive,
    send: Send,
    parsed: ParsedRequest,
    plan: AnswerPlan,
    keys: tuple[str, ...] = REASONING_KEYS,
    *,
    kv: KVRequest | None = None,
) -> None:
    """Serve a chat completion whose answer is ``plan`` (the module rules); reasoning goes
    under ``keys`` (:func:`reasoning_keys`); ``kv`` is its part in a prefill/decode
    hand-off (:mod:`inference_lab.serve.kv_transfer`)."""
    request_id = exchange.request_id or new_request_id("chat")
    created = int(time.time())
    ids = [[call_id() for _ in plan.calls] for _ in range(parsed.n)]
    encoder = ChatAgentEncoder(
        parsed, plan, request_id=request_id, created=created, call_ids=ids, reasoning_keys=keys
    )

    def body(finished: Finished) -> bytes:
        return chat_agent_body(
            parsed,
            plan,
            request_id=request_id,
            created=created,
            completion_tokens=finished.output_tokens,
            finish_reason=finished.finish_reason,
            call_ids=ids,
            reasoning_keys=keys,
            cached_tokens=finished.cached_tokens,
        )

    await serve_answer(
        state,
        runtime,
        exchange,
        receive,
        send,
        parsed=parsed,
        plan=plan,
        encoder=encoder,
        body=body,
        chat=True,
        block_hashes=prompt_chain(parsed, plan, runtime.deployment.scheduler.block_size),
        kv=kv,
    )


def prompt_chain(parsed: ParsedRequest, plan: AnswerPlan, block_size: int) -> tuple[int, ...]:
    """The hash chain an answer carries (Rule 5): a prose answer's whole chain (its
    prompt, then the placeholder answer it computes), a JSON answer's prompt blocks only
    (its document is not the placeholder text the chain's answer part stands for)."""
    if plan.fixed is None:
        return parsed.block_hashes
    return parsed.block_hashes[: parsed.prompt_tokens // block_size]


def _gone(handle: RequestHandle, sink: StreamSink | CollectSink) -> None:
    handle.close()
    sink.on_gone()


async def serve_answer(
    state: ServeState,
    runtime: ModelRuntime,
    exchange: Exchange,
    receive: Receive,
    send: Send,
    *,
    parsed: ParsedRequest,
    plan: AnswerPlan,
    encoder: FrameEncoder,
    body: Callable[[Finished], bytes],
    chat: bool,
    finished: Callable[[], None] | None = None,
    translate: Callable[[Reply], Reply] | None = None,
    block_hashes: tuple[int, ...] = (),
    kv: KVRequest | None = None,
) -> None:
    """Admit ``parsed`` (Rules 1-2) and answer it: ``encoder``'s stream, or
    ``body(finished)`` once it ended. ``finished`` is called after a stream ended with
    its closing events written (the Responses store); ``translate`` puts the refusals
    sent here into another API's envelope (the Messages API's); ``block_hashes`` (Rule
    5) go with the request to the router and the prefix cache; ``kv`` (a prefill/decode
    hand-off, :mod:`inference_lab.serve.kv_transfer`) claims its KV before admission and
    decorates its answer. Raises :class:`ApiError`, ``QueueFull`` or
    ``EngineUnavailable`` only before anything is sent."""
    exchange.note_pacing_lag(runtime.pacing_lag())  # (once: a chat's route noted it first)
    engine_prompt = max(1, parsed.prompt_tokens)
    refused = runtime.check_fits(engine_prompt, parsed.max_tokens, parsed.n)
    if refused is not None:
        raise ApiError(400, "context_length_exceeded", refused.reason, "max_tokens")
    check_work(parsed)
    if state.draining:
        refusal = shutting_down_reply()
        await send_reply(send, translate(refusal) if translate else refusal, exchange.headers)
        return
    try:
        await _answer(
            state,
            runtime,
            exchange,
            receive,
            send,
            parsed,
            plan,
            encoder,
            body,
            chat,
            finished,
            translate,
            block_hashes,
            kv,
        )
    finally:
        if kv is not None:
            kv.close()


async def _answer(
    state: ServeState,
    runtime: ModelRuntime,
    exchange: Exchange,
    receive: Receive,
    send: Send,
    parsed: ParsedRequest,
    plan: AnswerPlan,
    encoder: FrameEncoder,
    body: Callable[[Finished], bytes],
    chat: bool,
    finished: Callable[[], None] | None,
    translate: Callable[[Reply], Reply] | None,
    block_hashes: tuple[int, ...],
    kv: KVRequest | None,
) -> None:
    """:func:`serve_answer` once its checks passed: the claim, the admission, the answer."""
    engine_prompt = max(1, parsed.prompt_tokens)
    if kv is not None:
        await kv.begin(runtime, engine_prompt, exchange.scope)
    sink: StreamSink | CollectSink
    if parsed.stream:
        sink = AnswerSink(encoder, state, chat=chat)
    else:
        sink = CollectSink() if kv is None else kv.sink(runtime, exchange.request_id)
    limit, drawn = plan.limit(parsed)
    handle = runtime.admit_nowait(
        prompt_tokens=engine_prompt,
        max_tokens=parsed.max_tokens,
        priority=parsed.priority,
        sink=sink,
        arrival=exchange.arrival,
        n=parsed.n,
        limit=limit,
        drawn=drawn,
        min_length=parsed.min_tokens,
        block_hashes=block_hashes,
        model=parsed.model,
        session=parsed.session,
        **(kv.admission() if kv is not None else {}),
    )
    if kv is not None:
        kv.bind(handle)
    if block_hashes and parsed.hashed_tokens is not None:
        state.remember_tokens(parsed)  # the KV-events publisher names blocks' tokens
    try:
        if isinstance(sink, StreamSink):
            encoder.bind(handle.length)
            sink.last = handle.length
        await while_watched(
            send,
            receive,
            lambda: _gone(handle, sink),
            lambda: _respond(state, exchange, send, handle, sink, body, finished, translate, kv),
        )
    finally:
        handle.close()


async def _respond(
    state: ServeState,
    exchange: Exchange,
    send: Send,
    handle: RequestHandle,
    sink: StreamSink | CollectSink,
    body: Callable[[Finished], bytes],
    finished: Callable[[], None] | None,
    translate: Callable[[Reply], Reply] | None,
    kv: KVRequest | None = None,
) -> None:
    if isinstance(sink, StreamSink):
        if not handle.alone:
            await handle.wait_taken()
        headers = [*STREAM_HEADERS, *exchange.headers]
        start = {"type": "http.response.start", "status": 200, "headers": headers}
        if sink.pending() or state.delivery.interval > 0:
            await write_stream(send, sink, state.delivery, start)
        else:
            await send(start)
            await write_stream(send, sink, state.delivery)
        if sink.finished and not sink.gone and finished is not None:
            finished()
        return
    await sink.event.wait()
    handle.close()
    result = sink.finished
    reply = (
        Reply(200, body(result) if kv is None else kv.body(body(result)))
        if result is not None
        else sink.unfinished_reply(state.shutdown_message)
    )
    if reply is None:
        return
    if translate is not None and reply.status != 200:
        reply = translate(reply)
    with trio.CancelScope(shield=True):
        await send_reply(send, reply, exchange.headers)
    if kv is not None:
        kv.delivered = reply.status == 200 and not sink.gone
