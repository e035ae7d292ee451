"""``POST /v1/responses`` and ``POST /v1/embeddings`` on raw ASGI, and the stored
responses' ``GET`` / ``DELETE /v1/responses/{id}`` (Quart routes).

The app's ASGI connection (:mod:`inference_lab.serve.asgi`) calls the two POST routes of
:data:`AGENT_ROUTES` as it calls the completion routes: their bodies are read the same
way (:func:`~inference_lab.serve.completions.read_body`: 413, 408, pieces).

Rule 1: the contract before a response starts is the completion routes': body (413 /
        408 / 400) -> validation (400) -> model (404) -> fit (400) -> engine alive (503)
        -> depth (529), every refusal a whole reply in the OpenAI envelope.
Rule 2: an embeddings request is one prefill-only engine request per input (``max_tokens``
        1), all admitted in one synchronous pass or none: when one is refused, those
        admitted before it are withdrawn (``RequestHandle.withdraw``) and the request is
        a 529 / 503. It queues, batches and counts toward ``max_waiting`` like any other.
Rule 3: an embeddings answer is sent once every input finished, in pieces of one vector
        (with a checkpoint between), so a large batch never holds up the event loop; a
        client that leaves aborts every input.
Rule 4: a response is stored (``store``, default true) when it finished, bounded and
        evicted (:mod:`inference_lab.serve.response_store`); ``previous_response_id``
        continues a stored one's conversation, and names an unknown one with a 400.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio
from quart import Response
from quart_trio import QuartTrio

from inference_lab.api.agents import AnswerPlan, content_rng, plan_answer, reasoning_ratio
from inference_lab.api.embeddings import (
    check_dimensions,
    embedding_pieces,
    parse_embeddings_request,
)
from inference_lab.api.responses_api import (
    ResponseIds,
    ResponsesEncoder,
    final_response,
    now,
    parse_responses_request,
    response_messages,
)
from inference_lab.api.schema import parse_json_object
from inference_lab.errors import ApiError, EngineUnavailable, QueueFull, truncate_echo
from inference_lab.jsonbytes import dumps
from inference_lab.runtime.model import RequestHandle
from inference_lab.serve.agents import serve_answer
from inference_lab.serve.client_gone import while_watched
from inference_lab.serve.completions import (
    MAX_BODY_PIECES,
    BodyTimeout,
    BodyTooFragmented,
    BodyTooLarge,
    ClientGone,
    read_body,
)
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.response_store import StoredResponse
from inference_lab.serve.responses import (
    JSON,
    Reply,
    body_timeout_reply,
    body_too_fragmented_reply,
    body_too_large_reply,
    engine_failed_reply,
    error_reply,
    json_reply,
    send_reply,
    shutting_down_reply,
)
from inference_lab.serve.routes import to_response
from inference_lab.serve.state import ServeState
from inference_lab.serve.streaming import CollectSink

__all__ = ["AGENT_ROUTES", "register_response_routes", "request_body"]

Route = Callable[[ServeState, Exchange, Receive, Send], Awaitable[None]]


async def request_body(
    state: ServeState,
    exchange: Exchange,
    receive: Receive,
    send: Send,
    translate: Callable[[Reply], Reply] | None = None,
) -> bytes | None:
    """The request body, or None once a refusal was sent (or the client left); a route
    with another error envelope (the Messages API) passes ``translate``."""
    timeout = state.settings.body_timeout
    reply: Reply | None = None
    try:
        return await read_body(receive, exchange.scope, deadline=exchange.arrival + timeout)
    except BodyTooLarge:
        reply = body_too_large_reply()
    except BodyTooFragmented:
        reply = body_too_fragmented_reply(MAX_BODY_PIECES)
    except BodyTimeout:
        reply = body_timeout_reply(timeout)
    except ClientGone:
        pass
    if reply is not None:
        await send_reply(send, translate(reply) if translate else reply, exchange.headers)
    return None


async def _refuse(state: ServeState, exchange: Exchange, send: Send, exc: Exception) -> None:
    reply = error_reply(exc, should_retry_header=state.settings.should_retry_header)
    await send_reply(send, reply, exchange.headers)


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        "not_found",
        f"No response with id '{truncate_echo(response_id)}' is stored on this server.",
        "response_id",
    )


# ---------------------------------------------------------------------------------------
# POST /v1/responses


async def create_response(
    state: ServeState, exchange: Exchange, receive: Receive, send: Send
) -> None:
    """``POST /v1/responses`` (the module rules)."""
    body = await request_body(state, exchange, receive, send)
    if body is None:
        return
    settings = state.settings
    try:
        raw = parse_json_object(body)
        model = raw.get("model")
        tokenizer = settings.tokenizers.get(model) if type(model) is str else None
        previous = raw.get("previous_response_id")
        history: tuple[Any, ...] = ()
        if type(previous) is str:
            stored = state.responses.get(previous)
            if stored is None:
                raise ApiError(
                    400,
                    "previous_response_not_found",
                    f"Previous response with id '{truncate_echo(previous)}' not found (this "
                    "server keeps responses in memory, bounded: it may have been evicted)",
                    "previous_response_id",
                )
            history = stored.messages
        request = parse_responses_request(
            raw, settings.default_max_tokens, tokenizer=tokenizer, history=history
        )
        runtime = state.runtimes.get(request.parsed.model)
        if runtime is None:
            raise state.model_not_found(request.parsed.model)
        agent = request.agent
        reasoning = runtime.deployment.model.reasoning
        if agent.output is None and not agent.tools:  # prose: nothing to draw
            plan = AnswerPlan(ratio=reasoning_ratio(reasoning, agent.effort, agent.thinking))
        else:
            plan = (
                plan_answer(
                    agent,
                    content_rng(settings.seed or 0, raw),
                    reasoning=reasoning,
                    tool_call_probability=settings.tool_call_probability,
                )
                or AnswerPlan()
            )
        ids = ResponseIds.new(len(plan.calls))
        created = now()
        encoder = ResponsesEncoder(request, plan, ids, created_at=created)

        def store(final: dict[str, Any]) -> None:
            if request.store:
                messages = response_messages(request, final)
                state.responses.put(
                    ids.response, StoredResponse(body=dumps(final), messages=messages)
                )

        def answer(finished: Any) -> bytes:
            final = final_response(
                request,
                plan,
                ids,
                created_at=created,
                completion_tokens=finished.output_tokens,
                finish_reason=finished.finish_reason,
            )
            store(final)
            return dumps(final)

        def streamed() -> None:
            if encoder.final is not None:
                store(encoder.final)

        await serve_answer(
            state,
            runtime,
            exchange,
            receive,
            send,
            parsed=request.parsed,
            plan=plan,
            encoder=encoder,
            body=answer,
            chat=False,
            finished=streamed,
        )
    except (ApiError, QueueFull, EngineUnavailable) as exc:
        await _refuse(state, exchange, send, exc)


def register_response_routes(app: QuartTrio, state: ServeState) -> None:
    """``GET`` and ``DELETE /v1/responses/{id}`` of stored responses (Rule 4)."""

    @app.get("/v1/responses/<response_id>")
    async def retrieve_response(response_id: str) -> Response:
        stored = state.responses.get(response_id)
        if stored is None:
            return to_response(error_reply(_not_found(response_id)))
        return to_response(Reply(200, stored.body))

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        if not state.responses.delete(response_id):
            return to_response(error_reply(_not_found(response_id)))
        return to_response(
            json_reply({"id": response_id, "object": "response.deleted", "deleted": True})
        )


# ---------------------------------------------------------------------------------------
# POST /v1/embeddings


class _Batch:
    """The sinks of one embeddings request's inputs: done when all finished, or when one
    failed or the client left."""

    def __init__(self, count: int) -> None:
        self.sinks = [CollectSink() for _ in range(count)]
        self.handles: list[RequestHandle] = []

    def gone(self) -> None:
        for handle in self.handles:
            handle.close()
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


async def create_embeddings(
    state: ServeState, exchange: Exchange, receive: Receive, send: Send
) -> None:
    """``POST /v1/embeddings`` (the module rules)."""
    body = await request_body(state, exchange, receive, send)
    if body is None:
        return
    settings = state.settings
    batch: _Batch | None = None
    try:
        raw = parse_json_object(body)
        model = raw.get("model")
        tokenizer = settings.tokenizers.get(model) if type(model) is str else None
        request = parse_embeddings_request(raw, tokenizer=tokenizer)
        runtime = state.runtimes.get(request.model)
        if runtime is None:
            raise state.model_not_found(request.model)
        model_dim = settings.embedding_size(runtime.deployment)
        dim = check_dimensions(request, model_dim)
        for i, tokens in enumerate(request.tokens):
            refused = runtime.check_fits(max(1, tokens), 1)
            if refused is not None:
                where = "input" if len(request.tokens) == 1 else f"input[{i}]"
                raise ApiError(400, "context_length_exceeded", refused.reason, where)
        if state.draining:
            await send_reply(send, shutting_down_reply(), exchange.headers)
            return
        batch = _Batch(len(request.tokens))
        try:
            for tokens, sink in zip(request.tokens, batch.sinks, strict=True):
                handle = runtime.admit_nowait(
                    prompt_tokens=max(1, tokens),
                    max_tokens=1,
                    priority=request.priority,
                    sink=sink,
                    arrival=exchange.arrival,
                    limit=1,
                    drawn=False,
                )
                batch.handles.append(handle)
        except (QueueFull, EngineUnavailable):
            for handle in batch.handles:
                handle.withdraw()  # all or none (Rule 2)
            batch.handles.clear()
            raise
    except (ApiError, QueueFull, EngineUnavailable) as exc:
        await _refuse(state, exchange, send, exc)
        return
    try:
        await while_watched(send, receive, batch.gone, batch.wait)
        batch.close()
        failed = next((s for s in batch.sinks if s.finished is None), None)
        if failed is not None:
            if failed.gone:
                return
            if state.shutdown_message is not None:
                reply = shutting_down_reply(state.shutdown_message)
            else:
                reply = engine_failed_reply(failed.failure or "The engine failed.")
            with trio.CancelScope(shield=True):
                await send_reply(send, reply, exchange.headers)
            return
        await _send_pieces(send, exchange, embedding_pieces(request, settings.seed or 0, dim))
    finally:
        batch.close()


#: A body is sent in messages of about this many bytes (a small one whole, in one write).
SEND_CHUNK = 256 * 1024


async def _send_pieces(send: Send, exchange: Exchange, pieces: Iterator[bytes]) -> None:
    """A 200 JSON body built piece by piece with a checkpoint after each (Rule 3), sent in
    messages of about :data:`SEND_CHUNK` bytes; a body smaller than that is one reply."""
    buffer: list[bytes] = []
    size = 0
    started = False
    for piece in pieces:
        buffer.append(piece)
        size += len(piece)
        if size >= SEND_CHUNK:
            if not started:
                headers = [(b"content-type", JSON), *exchange.headers]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True
            await send({"type": "http.response.body", "body": b"".join(buffer), "more_body": True})
            buffer, size = [], 0
        await trio.lowlevel.checkpoint()
    with trio.CancelScope(shield=True):
        if not started:
            await send_reply(send, Reply(200, b"".join(buffer)), exchange.headers)
        else:
            await send({"type": "http.response.body", "body": b"".join(buffer), "more_body": False})


#: Path -> the raw ASGI route serving ``POST`` on it.
AGENT_ROUTES: dict[str, Route] = {
    "/v1/responses": create_response,
    "/v1/embeddings": create_embeddings,
}
