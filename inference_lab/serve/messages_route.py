"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
on raw ASGI, as vLLM serves them.

The app's ASGI connection (:mod:`inference_lab.serve.asgi`) calls them as it calls the
completion routes. A message is admitted, paced and written by the agent answers'
path (:func:`~inference_lab.serve.agents.serve_answer`): the same engine, admission
(a full queue is a 529), prefix caching and delivery as a chat completion.

Rule 1: the contract before a response starts is the completion routes': body (413 /
        408 / 400) -> validation (400) -> model (404) -> fit (400) -> engine alive (503)
        -> depth (529), and every refusal -- the gate's too (:func:`anthropic_reply`) --
        is in Anthropic's envelope, a 529 as ``overloaded_error``.
Rule 2: ``count_tokens`` counts the prompt as ``/v1/messages`` would (its system, tools
        and messages) and admits nothing.
Rule 3: the Messages routes take the API key as Anthropic's clients send it
        (``x-api-key``) as well as ``Authorization: Bearer`` (the gate).
Rule 4: a request's ``model`` may name a LoRA adapter, as on the completion routes (vLLM's
        Messages handler answers through its chat completions): it runs on its base
        model with that adapter, counted by the base model's tokenizer and hashed by its
        prefix rule, and the answer's ``model`` is the adapter's name.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from inference_lab.api.agents import AnswerPlan, content_rng, plan_answer, reasoning_ratio
from inference_lab.api.messages_encoding import (
    MessageIds,
    MessagesEncoder,
    anthropic_error_body,
    message_body,
)
from inference_lab.api.messages_request import MessagesRequest, parse_messages_request
from inference_lab.api.schema import parse_json_object
from inference_lab.errors import ApiError, EngineUnavailable, QueueFull
from inference_lab.jsonbytes import dumps
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve.agent_routes import request_body
from inference_lab.serve.agents import prompt_chain, serve_answer
from inference_lab.serve.error_replies import Reply, error_reply, send_reply
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.state import ServeState

__all__ = ["MESSAGES_PATHS", "MESSAGES_ROUTES", "anthropic_reply", "is_messages_path"]

#: The paths whose answers are in Anthropic's envelope.
MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def is_messages_path(path: str) -> bool:
    return path in MESSAGES_PATHS


def anthropic_reply(reply: Reply) -> Reply:
    """``reply`` (an error in OpenAI's envelope, from anywhere in the server) in
    Anthropic's envelope, its status and headers kept (Rule 1)."""
    if reply.status < 400:
        return reply
    message = ""
    try:
        parsed = json.loads(reply.body)
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
    except ValueError:
        message = reply.body.decode("utf-8", "replace")
    return attrs.evolve(reply, body=anthropic_error_body(reply.status, message))


async def _refuse(state: ServeState, exchange: Exchange, send: Send, exc: Exception) -> None:
    reply = error_reply(exc, should_retry_header=state.settings.should_retry_header)
    await send_reply(send, anthropic_reply(reply), exchange.headers)


def _plan(
    state: ServeState, raw: dict[str, Any], request: MessagesRequest, runtime: ModelRuntime
) -> AnswerPlan:
    """The answer's shape: prose (reasoning as ``thinking`` asks), or, with tools, what
    ``tool_choice`` and the conversation draw (``api/tool_choice.py``)."""
    agent = request.agent
    reasoning = runtime.deployment.model.reasoning
    if not agent.tools:
        return AnswerPlan(ratio=reasoning_ratio(reasoning, agent.effort, agent.thinking))
    settings = state.settings
    planned = plan_answer(
        agent,
        content_rng(settings.seed or 0, raw),
        reasoning=reasoning,
        tool_call_probability=settings.tool_call_probability,
    )
    return planned or AnswerPlan()


async def create_message(
    state: ServeState, exchange: Exchange, receive: Receive, send: Send
) -> None:
    """``POST /v1/messages`` (the module rules)."""
    body = await request_body(state, exchange, receive, send, anthropic_reply)
    if body is None:
        return
    settings = state.settings
    try:
        raw = parse_json_object(body)
        model = state.counted_as(raw.get("model"))  # (Rule 4)
        request = parse_messages_request(
            raw,
            tokenizer=settings.tokenizers.get(model) if type(model) is str else None,
            hashing=state.hashing.get(model) if type(model) is str else None,
        )
        runtime = state.runtime_for(request.parsed.model)
        if runtime is None:
            raise state.model_not_found(request.parsed.model)
        plan = _plan(state, raw, request, runtime)
        ids = MessageIds(len(plan.calls))
        encoder = MessagesEncoder(request, plan, ids)

        def answer(finished: Any) -> bytes:
            return dumps(
                message_body(
                    request,
                    plan,
                    ids,
                    completion_tokens=finished.output_tokens,
                    finish_reason=finished.finish_reason,
                    cached_tokens=finished.cached_tokens,
                )
            )

        block_size = runtime.deployment.scheduler.block_size
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
            translate=anthropic_reply,
            block_hashes=prompt_chain(request.parsed, plan, block_size),
        )
    except (ApiError, QueueFull, EngineUnavailable) as exc:
        await _refuse(state, exchange, send, exc)


async def count_tokens(state: ServeState, exchange: Exchange, receive: Receive, send: Send) -> None:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}`` (Rule 2)."""
    body = await request_body(state, exchange, receive, send, anthropic_reply)
    if body is None:
        return
    try:
        raw = parse_json_object(body)
        model = state.counted_as(raw.get("model"))  # (Rule 4)
        tokenizer = state.settings.tokenizers.get(model) if type(model) is str else None
        request = parse_messages_request(raw, tokenizer=tokenizer, count_only=True)
        if state.runtime_for(request.parsed.model) is None:
            raise state.model_not_found(request.parsed.model)
    except ApiError as exc:
        await _refuse(state, exchange, send, exc)
        return
    reply = Reply(200, dumps({"input_tokens": request.parsed.prompt_tokens}))
    await send_reply(send, reply, exchange.headers)


#: Path -> the raw ASGI route serving ``POST`` on it.
MESSAGES_ROUTES = {
    "/v1/messages": create_message,
    "/v1/messages/count_tokens": count_tokens,
}
