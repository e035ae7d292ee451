"""The side-channel routes of prefill/decode hand-offs (``docs/disaggregation.md``, "In
serve").

- ``POST /kv_transfer/claim`` and ``POST /kv_transfer/release``, on a prefill server: a
  decode server checks the KV a request's params name before it admits the request, and
  says when it has pulled it (``serve/kv_holds.py``: this simulator's stand-in for
  NIXL's side channel and notification). Raw ASGI routes (``KV_ROUTES``), as the
  completion routes: they are on a request's critical path.
- ``GET /kv_transfer/admission?model=NAME``, on any server: whether a request for the
  model would be admitted now, answered as an admission refuses (200, 529 with
  ``Retry-After``, 503), so a proxy can ask a decode server before a prefill is spent on
  a request it would refuse. The connection answers it where it reads it, before the
  queue of work (``transport.quick``, as ``GET /health``), for each served model's
  target (:func:`admission_target`); the Quart route answers it everywhere else.

Rule 1: the routes pass the gate like the API (the API key when the server has one);
        bodies are read by the strict converter, unknown keys refused (400).
Rule 2: on a server that is not of role ``prefill`` the claim and release routes answer 404
        ``kv_not_found``: it holds no KV.
Rule 3: the admission answer is the snapshot's verdict: a model whose engine is not running
        or sleeps is a 503, one whose waiting places are all taken (``max_waiting`` > 0
        and the places held reach it) a 529; it holds nothing and counts no refusal. With
        one replica it is what an arrival at that instant would get; with several it
        looks at the model's total, not the replica the router would pick.
Rule 4: a claim or release the connection read whole in one read is answered where it is
        read (``transport.quick``, :func:`quick_kv`), before the queue of work: each
        decode request waits for its claim. Its reply is :func:`kv_reply`, the raw route's
        own, after the same gate; a body over the route's size limit is left to the route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import trio
from quart import Response, request
from quart_trio import QuartTrio

from inference_lab.api.kv_transfer import ClaimBody, ReleaseBody
from inference_lab.api.requests import MAX_BODY_BYTES
from inference_lab.api.schema import parse_json_object, structure
from inference_lab.errors import ApiError, EngineSleeping, EngineUnavailable, QueueFull
from inference_lab.serve import gate
from inference_lab.serve.agent_routes import request_body
from inference_lab.serve.error_replies import (
    Reply,
    error_reply,
    json_reply,
    send_reply,
)
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.kv_holds import KVHolds
from inference_lab.serve.kv_pulls import CLAIM_PATH, RELEASE_PATH
from inference_lab.serve.routes import to_response
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport import QuickReply

__all__ = [
    "ADMISSION_PATH",
    "KV_QUICK_POSTS",
    "KV_ROUTES",
    "admission_reply",
    "admission_target",
    "kv_reply",
    "quick_admission",
    "quick_kv",
    "register_kv_routes",
]

#: The admission probe's path (Rule 3).
ADMISSION_PATH = "/kv_transfer/admission"


def admission_target(model: str) -> str:
    """The request target a proxy asks for ``model`` (its name percent-encoded, every
    reserved character included): the one the connection answers itself."""
    return f"{ADMISSION_PATH}?model={quote(model, safe='')}"


def _holds(state: ServeState) -> KVHolds:
    held = state.kv.holds
    if held is None:
        raise ApiError(
            404,
            "kv_not_found",
            f"this server's role is {state.kv.role}: it holds no KV for decode servers "
            "(inference-lab serve --role prefill does)",
            "kv_transfer_params",
        )
    return held


#: Path -> what its ``POST`` answers, given the holds and the body's JSON object.
_ANSWERS: dict[str, Callable[[KVHolds, dict[str, Any]], dict[str, Any]]] = {
    CLAIM_PATH: lambda holds, raw: holds.claim(structure(raw, ClaimBody, strict=True)),
    RELEASE_PATH: lambda holds, raw: holds.release(structure(raw, ReleaseBody, strict=True)),
}


def kv_reply(state: ServeState, path: str, body: bytes) -> Reply:
    """Rule 4: the answer to a side-channel ``POST`` on ``path`` (a key of
    :data:`KV_ROUTES`) whose whole body is ``body``, once it passed the gate."""
    try:
        return json_reply(_ANSWERS[path](_holds(state), parse_json_object(body)))
    except ApiError as exc:
        return error_reply(exc)


def _raw_route(path: str) -> Callable[[ServeState, Exchange, Receive, Send], Awaitable[None]]:
    async def route(state: ServeState, exchange: Exchange, receive: Receive, send: Send) -> None:
        body = await request_body(state, exchange, receive, send)
        if body is None:
            return
        reply = kv_reply(state, path, body)
        with trio.CancelScope(shield=True):
            await send_reply(send, reply, exchange.headers)

    return route


#: The raw ASGI routes (``POST``) of the side channel (``serve/asgi.py`` dispatches them).
KV_ROUTES = {path: _raw_route(path) for path in _ANSWERS}
#: Their request targets, which the connection may answer itself (Rule 4).
KV_QUICK_POSTS = frozenset(path.encode() for path in KV_ROUTES)


def quick_kv(
    state: ServeState,
    path: str,
    headers: list[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
    body: bytes,
) -> QuickReply | None:
    """Rule 4: the whole answer to a side-channel ``POST`` the connection read whole,
    gated as every request is; None for another path or a body the route would refuse
    for its size (the route answers those)."""
    if path not in _ANSWERS or len(body) > MAX_BODY_BYTES:
        return None
    exchange = Exchange.read_whole("POST", path, headers, client, trio.current_time())
    return gate.quick_reply(state, exchange, lambda: kv_reply(state, path, body))


def admission_reply(state: ServeState, name: str | None) -> Reply:
    """Rule 3: the answer to the admission probe for model ``name``."""
    try:
        if name is None:
            raise ApiError(400, "invalid_value", "model is required", "model")
        runtime = state.runtimes.get(name)
        if runtime is None:
            raise state.model_not_found(name)
        snap = runtime.snapshot()
        if not snap.alive:
            raise EngineUnavailable(name)
        if runtime.sleep_level:
            raise EngineSleeping(name)
        if snap.max_waiting and snap.depth >= snap.max_waiting:
            raise QueueFull(name, snap.depth, snap.max_waiting, runtime.retry_after())
    except (ApiError, EngineUnavailable, QueueFull) as exc:
        return error_reply(exc, should_retry_header=state.settings.should_retry_header)
    return json_reply(
        {
            "model": name,
            "admits": True,
            "waiting_places": snap.depth,
            "max_waiting": snap.max_waiting,
        }
    )


def quick_admission(
    state: ServeState,
    method: str,
    target: str,
    headers: list[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
) -> QuickReply | None:
    """The whole answer to an admission probe the connection offers (``GET`` of a served
    model's :func:`admission_target`), gated as every request is; None for any other."""
    path, _, query = target.partition("?")
    if method != "GET" or path != ADMISSION_PATH:
        return None
    name = next((m for m in state.runtimes if admission_target(m) == target), None)
    if name is None:
        return None
    scope: dict[str, Any] = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query.encode("latin-1"),
        "headers": headers,
        "client": client,
    }
    exchange = Exchange(scope, trio.current_time())
    return gate.quick_reply(state, exchange, lambda: admission_reply(state, name))


def register_kv_routes(app: QuartTrio, state: ServeState) -> None:
    """The admission probe's Quart route (where the connection does not answer it)."""

    @app.get(ADMISSION_PATH)
    async def kv_admission() -> Response:
        return to_response(admission_reply(state, request.args.get("model")))
