"""vLLM's pooling routes on raw ASGI: ``POST /v1/rerank`` (also ``/rerank`` and
``/v2/rerank``), ``/v1/score`` (also ``/score``), ``/classify`` and ``/pooling``.

Rule 1: a model answers them only when it is served as a pooling model
        (``--pooling-models``, ``ServeSettings.pooling_models``); another model's request
        is a 400 naming the API, as vLLM's when its model has no such task.
Rule 2: the contract before an answer is ``/v1/embeddings``': body (413 / 408 / 400) ->
        validation (400, :mod:`inference_lab.api.pooling`) -> model (404) -> pooling
        model (400) -> fit (400) -> engine alive (503) -> depth (529), every refusal in
        OpenAI's envelope.
Rule 3: each item is one prefill-only engine request, admitted all or none, and the
        answer goes once every item finished (:mod:`inference_lab.serve.prefill_batch`):
        priced as the prefill step it is.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from inference_lab.api.pooling import (
    PoolingRequest,
    check_pooling_dimensions,
    parse_classify_request,
    parse_pooling_request,
    parse_rerank_request,
    parse_score_request,
    pooling_pieces,
)
from inference_lab.api.schema import parse_json_object
from inference_lab.api.tokenizer import Tokenizer
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.serve.agent_routes import request_body
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.prefill_batch import refuse, serve_prefill_batch
from inference_lab.serve.state import ServeState

__all__ = ["POOLING_ROUTES"]

Route = Callable[[ServeState, Exchange, Receive, Send], Awaitable[None]]

#: Each API's name in vLLM's refusal of a model without the task (Rule 1).
API_NAMES = {
    "rerank": "Rerank (Score) API",
    "score": "Score API",
    "classify": "Classification API",
    "pooling": "Pooling API",
}


def _not_pooling(model: str, kind: str) -> ApiError:
    return ApiError(
        400,
        "model_not_supported",
        f"The model '{truncate_echo(model)}' does not support the {API_NAMES[kind]}: it is "
        "not served as a pooling model (serve it with --pooling-models)",
        "model",
    )


def _parse(kind: str, raw: Mapping[str, Any], tokenizer: Tokenizer | None) -> PoolingRequest:
    if kind == "rerank":
        return parse_rerank_request(raw, tokenizer=tokenizer)
    if kind == "score":
        return parse_score_request(raw, tokenizer=tokenizer)
    if kind == "classify":
        return parse_classify_request(raw, tokenizer=tokenizer)
    return parse_pooling_request(raw, tokenizer=tokenizer)


def _route(kind: str) -> Route:
    async def route(state: ServeState, exchange: Exchange, receive: Receive, send: Send) -> None:
        body = await request_body(state, exchange, receive, send)
        if body is None:
            return
        settings = state.settings
        seed = settings.seed or 0
        try:
            raw = parse_json_object(body)
            model = raw.get("model")
            tokenizer = settings.tokenizers.get(model) if type(model) is str else None
            request = _parse(kind, raw, tokenizer)
            runtime = state.runtimes.get(request.model)
            if runtime is None:
                raise state.model_not_found(request.model)
            if request.model not in settings.pooling_models:
                raise _not_pooling(request.model, kind)
            dim = check_pooling_dimensions(request, settings.embedding_size(runtime.deployment))
        except ApiError as exc:
            await refuse(state, exchange, send, exc)
            return
        created = int(time.time())
        await serve_prefill_batch(
            state,
            exchange,
            receive,
            send,
            runtime=runtime,
            tokens=request.tokens,
            priority=request.priority,
            where=request.where,
            pieces=lambda: pooling_pieces(request, seed=seed, created=created, dim=dim),
        )

    route.__name__ = f"create_{kind}"
    route.__doc__ = f"``POST`` of vLLM's {API_NAMES[kind]} (the module rules)."
    return route


#: Path -> the raw ASGI route serving ``POST`` on it.
POOLING_ROUTES: dict[str, Route] = {
    "/v1/rerank": _route("rerank"),
    "/rerank": _route("rerank"),
    "/v2/rerank": _route("rerank"),
    "/v1/score": _route("score"),
    "/score": _route("score"),
    "/classify": _route("classify"),
    "/pooling": _route("pooling"),
}
