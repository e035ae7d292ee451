"""``POST /v1/responses`` and ``POST /v1/embeddings`` on raw ASGI, and the stored
responses' ``GET`` / ``DELETE /v1/responses/{id}`` (Quart routes).

The app's ASGI connection (:mod:`inference_lab.serve.asgi`) calls the two POST routes of
:data:`AGENT_ROUTES` as it calls the completion routes: their bodies are read the same
way (:func:`~inference_lab.serve.request_body.read_body`: 413, 408, pieces).

Rule 1: the contract before a response starts is the completion routes': body (413 /
        408 / 400) -> validation (400) -> model (404) -> fit (400) -> engine alive (503)
        -> depth (529), every refusal a whole reply in the OpenAI envelope.
Rule 2: an embeddings request is one prefill-only engine request per input, admitted
        all or none and answered in pieces (:mod:`inference_lab.serve.prefill_batch`).
Rule 3: a response is stored (``store``, default true) when it finished, bounded and
        evicted (:mod:`inference_lab.serve.response_store`); ``previous_response_id``
        continues a stored one's conversation, and names an unknown one with a 400.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

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
    response_messages,
)
from inference_lab.api.responses_request import ResponsesRequest, parse_responses_request
from inference_lab.api.schema import parse_json_object
from inference_lab.errors import ApiError, EngineUnavailable, QueueFull, truncate_echo
from inference_lab.jsonbytes import dumps
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve.agents import serve_answer
from inference_lab.serve.error_replies import (
    Reply,
    error_reply,
    json_reply,
    send_reply,
)
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.generation import INLINE_BODY, plan_off_loop
from inference_lab.serve.prefill_batch import refuse, serve_prefill_batch
from inference_lab.serve.request_body import BodyRefused, ClientGone, body_refusal, read_body
from inference_lab.serve.response_store import StoredResponse
from inference_lab.serve.routes import to_response
from inference_lab.serve.state import ServeState

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
    try:
        return await read_body(receive, exchange.scope, deadline=exchange.arrival + timeout)
    except ClientGone:
        return None
    except BodyRefused as refused:
        reply = body_refusal(refused, timeout)
    await send_reply(send, translate(reply) if translate else reply, exchange.headers)
    return None


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        "not_found",
        f"No response with id '{truncate_echo(response_id)}' is stored on this server.",
        "response_id",
    )


# ---------------------------------------------------------------------------------------
# POST /v1/responses


def _history(state: ServeState, raw: Mapping[str, Any]) -> tuple[Any, ...]:
    """The stored conversation ``previous_response_id`` names (none without it); a 400
    when it is not (or no longer) stored."""
    previous = raw.get("previous_response_id")
    if type(previous) is not str:
        return ()
    stored = state.responses.get(previous)
    if stored is None:
        raise ApiError(
            400,
            "previous_response_not_found",
            f"Previous response with id '{truncate_echo(previous)}' not found (this "
            "server keeps responses in memory, bounded: it may have been evicted)",
            "previous_response_id",
        )
    return stored.messages


async def _plan(
    state: ServeState,
    runtime: ModelRuntime,
    request: ResponsesRequest,
    raw: Mapping[str, Any],
    *,
    inline: bool,
) -> AnswerPlan:
    """The answer's plan: prose needs no draw; tools and structured output are planned
    within the generation budget, off the event loop past its first units."""
    agent = request.agent
    reasoning = runtime.deployment.model.reasoning
    if agent.output is None and not agent.tools:  # prose: nothing to draw
        return AnswerPlan(ratio=reasoning_ratio(reasoning, agent.effort, agent.thinking))
    settings = state.settings
    plan = await plan_off_loop(
        lambda budget: plan_answer(
            agent,
            content_rng(settings.seed or 0, raw),
            reasoning=reasoning,
            tool_call_probability=settings.tool_call_probability,
            budget=budget,
        ),
        inline=inline,
    )
    return plan or AnswerPlan()


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
        request = parse_responses_request(
            raw, settings.default_max_tokens, tokenizer=tokenizer, history=_history(state, raw)
        )
        runtime = state.runtimes.get(request.parsed.model)
        if runtime is None:
            raise state.model_not_found(request.parsed.model)
        plan = await _plan(state, runtime, request, raw, inline=len(body) <= INLINE_BODY)
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
        await refuse(state, exchange, send, exc)


def register_response_routes(app: QuartTrio, state: ServeState) -> None:
    """``GET`` and ``DELETE /v1/responses/{id}`` of stored responses (Rule 3)."""

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


async def create_embeddings(
    state: ServeState, exchange: Exchange, receive: Receive, send: Send
) -> None:
    """``POST /v1/embeddings`` (the module rules)."""
    body = await request_body(state, exchange, receive, send)
    if body is None:
        return
    settings = state.settings
    try:
        raw = parse_json_object(body)
        model = raw.get("model")
        tokenizer = settings.tokenizers.get(model) if type(model) is str else None
        request = parse_embeddings_request(raw, tokenizer=tokenizer)
        runtime = state.runtimes.get(request.model)
        if runtime is None:
            raise state.model_not_found(request.model)
        dim = check_dimensions(request, settings.embedding_size(runtime.deployment))
    except ApiError as exc:
        await refuse(state, exchange, send, exc)
        return
    single = len(request.tokens) == 1
    await serve_prefill_batch(
        state,
        exchange,
        receive,
        send,
        runtime=runtime,
        tokens=request.tokens,
        priority=request.priority,
        where=lambda i: "input" if single else f"input[{i}]",
        pieces=lambda: embedding_pieces(request, settings.seed or 0, dim),
    )


#: Path -> the raw ASGI route serving ``POST`` on it.
AGENT_ROUTES: dict[str, Route] = {
    "/v1/responses": create_response,
    "/v1/embeddings": create_embeddings,
}
