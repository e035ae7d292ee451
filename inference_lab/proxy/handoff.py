"""One completion through the proxy: the two-step hand-off of vLLM's toy proxy and llm-d's
routing sidecar, over ``serve --role prefill`` and ``serve --role decode`` servers.

1. **Admission probe** (unless ``--no-admission-probe``): the decode backends are asked in
   pool order, ``GET /kv_transfer/admission?model=...``, and the first that would admit
   the request now takes it; when none would, the last refusal (its 529 with
   ``Retry-After``, or 503) goes back to the client unchanged and no prefill is spent.
2. **Prefill**: the request goes to a prefill backend with ``max_tokens: 1`` (and
   ``max_completion_tokens: 1`` when given), ``stream: false``, no ``stream_options``,
   ``min_tokens`` / ``min_completion_tokens`` left out and ``kv_transfer_params:
   {"do_remote_decode": true, "do_remote_prefill": false, ...null fields}``, as vLLM's
   toy proxy sends it. A refusal (any status but 200) goes back unchanged.
3. **Decode**: the original request goes to the chosen decode backend with the prefill
   answer's ``kv_transfer_params``; its answer, streamed or not, passes through as it
   arrives.

Rule 1: a backend that cannot be reached is skipped for the next of its pool (a prefill, or
        a decode before its answer began); when none is left the client gets a 503
        ``backend_unavailable`` in the OpenAI envelope naming them, never a 500 or a hang
        (every wait is bounded: ``backends.py`` Rule 3).
Rule 2: the prefill's held KV is never left behind by the proxy: when the decode step ends
        without a decode server having taken the request (every decode backend down, a
        decode refusal, the client gone before the decode answered), the proxy releases it
        on the prefill server (``POST /kv_transfer/release``); a decode server that took it
        releases it itself.
Rule 3: the client's ``Authorization`` and ``X-Request-Id`` (one generated when absent) go
        with every call for its request, to both pools, as the toy proxy sends them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote

import attrs
import trio

from inference_lab.errors import error_body
from inference_lab.jsonbytes import dumps
from inference_lab.proxy.backends import Backend, BackendFailed, Exchange, Pool
from inference_lab.serve.transport import chunk_writer

__all__ = ["HandoffStats", "ProxyReply", "prefill_request", "serve_completion"]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: The prefill answer's body is read whole, up to this many bytes.
PREFILL_BODY_LIMIT = 16 << 20
#: The field of both steps.
FIELD = "kv_transfer_params"
#: Seconds a release of held KV (Rule 2) may take.
RELEASE_TIMEOUT = 5.0


@attrs.frozen
class ProxyReply:
    """A whole answer the proxy sends itself (or passes on whole)."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),)


def unavailable(message: str) -> ProxyReply:
    """Rule 1's 503."""
    body = error_body(message, "service_unavailable_error", "backend_unavailable", None)
    return ProxyReply(503, body, ((b"content-type", b"application/json"), (b"retry-after", b"1")))


#: The stages of a request through the proxy that :class:`HandoffStats` times.
STAGES = ("front", "prefill", "handoff", "decode_head")


@attrs.define
class HandoffStats:
    """What the proxy did: requests by outcome, and where their time went, per stage
    (seconds summed, and how many requests passed the stage): ``front`` from a request's
    body read to its prefill request sent (the admission probe included), ``prefill``
    from there to the prefill's answer read, ``handoff`` from there to the decode request
    sent, ``decode_head`` from there to the decode answer's head (the decode server's
    claim and admission)."""

    requests: int = 0
    completed: int = 0
    passed_refusals: int = 0
    probe_refusals: int = 0
    unavailable: int = 0
    released: int = 0
    seconds: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(STAGES, 0.0))
    counts: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(STAGES, 0))

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds
        self.counts[stage] += 1

    def summary(self) -> dict[str, dict[str, float]]:
        """Each stage's count, total and mean (ms; the mean 0 before any request passed
        it)."""
        out: dict[str, dict[str, float]] = {}
        for stage in STAGES:
            count, total = self.counts[stage], self.seconds[stage] * 1e3
            out[stage] = {
                "count": count,
                "total_ms": total,
                "mean_ms": total / count if count else 0.0,
            }
        return out


def prefill_request(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Step 2's body: the request as vLLM's toy proxy sends it to a prefill server."""
    body = dict(raw)
    body[FIELD] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(key, None)
    return body


@attrs.define(eq=False)
class _Call:
    """One client request's part: its body, the headers its backend calls carry, and the
    prefill's held KV while nobody else answers for it (Rule 2)."""

    path: str
    raw: dict[str, Any]
    headers: list[tuple[str, str]]
    timeout: float
    held: tuple[Backend, dict[str, Any]] | None = None


async def _send_whole(send: Send, reply: ProxyReply) -> None:
    headers = [*reply.headers, (b"content-length", str(len(reply.body)).encode())]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body, "more_body": False})


async def _probe(call: _Call, decode: Pool) -> tuple[Backend | None, ProxyReply | None]:
    """Step 1: the decode backend that would admit the request now, else the refusal to
    send (Rule 1 for backends that cannot be reached)."""
    model = call.raw.get("model")
    order = decode.order()
    if not isinstance(model, str):
        return order[0], None  # (the decode server's own 400 names the field)
    refusal: ProxyReply | None = None
    down: list[str] = []
    target = f"/kv_transfer/admission?model={quote(model, safe='')}"
    for backend in order:
        try:
            async with Exchange(backend, call.timeout, "GET", target, call.headers) as answer:
                body = await answer.body(PREFILL_BODY_LIMIT)
        except BackendFailed as exc:
            down.append(str(exc))
            continue
        if answer.status == 200:
            return backend, None
        refusal = ProxyReply(answer.status, body, tuple(answer.headers))
    return None, refusal or unavailable("no decode backend could be reached: " + "; ".join(down))


async def _prefill(
    call: _Call, prefill: Pool
) -> tuple[Backend, dict[str, Any] | None] | ProxyReply:
    """Step 2: the prefill backend that answered and its answer's params (None: it sent
    none), else the reply to pass on (a refusal unchanged, Rule 1's 503)."""
    body = dumps(prefill_request(call.raw))
    down: list[str] = []
    for backend in prefill.order():
        try:
            async with Exchange(
                backend, call.timeout, "POST", call.path, call.headers, body
            ) as answer:
                data = await answer.body(PREFILL_BODY_LIMIT)
        except BackendFailed as exc:
            down.append(str(exc))
            continue
        if answer.status != 200:
            return ProxyReply(answer.status, data, tuple(answer.headers))
        try:
            params = json.loads(data).get(FIELD)
        except (ValueError, AttributeError):
            params = None
        return backend, params if isinstance(params, dict) else None
    return unavailable("no prefill backend could be reached: " + "; ".join(down))


async def _release(call: _Call, stats: HandoffStats) -> None:
    """Rule 2: the prefill's held KV back, if the proxy still answers for it."""
    held, call.held = call.held, None
    if held is None:
        return
    backend, params = held
    body = dumps({k: params.get(k) for k in ("remote_engine_id", "remote_request_id")})
    with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT):
        try:
            async with Exchange(
                backend, RELEASE_TIMEOUT, "POST", "/kv_transfer/release", call.headers, body
            ) as answer:
                await answer.body(PREFILL_BODY_LIMIT)
            if answer.status == 200:
                stats.released += 1
        except BackendFailed:
            pass  # (its expiry gives the blocks back)


async def _decode(
    call: _Call, order: list[Backend], send: _Started, stats: HandoffStats, answered: float
) -> ProxyReply | None:
    """Step 3: the decode answer passed through as it arrives; the reply to send instead
    when no decode backend could be reached (Rule 1). A refusal passes through too. A
    backend that fails once its answer began cannot be answered for with a status: the
    :class:`BackendFailed` goes up and the client's connection is cut."""
    body = dumps(call.raw)
    down: list[str] = []
    for backend in order:
        sent = trio.current_time()
        if answered:
            stats.add("handoff", sent - answered)
            answered = 0.0
        try:
            async with Exchange(
                backend, call.timeout, "POST", call.path, call.headers, body
            ) as answer:
                stats.add("decode_head", trio.current_time() - sent)
                if answer.status == 200:
                    call.held = None  # the decode server answers for the KV now
                    stats.completed += 1
                else:
                    stats.passed_refusals += 1
                start = {"status": answer.status, "headers": answer.headers}
                await send({"type": "http.response.start", **start})
                write = chunk_writer(send.raw)  # (pre-framed chunks, past h11, when hooked)
                while not answer.ended:
                    data = await answer.chunk()
                    if not data:
                        continue
                    if write is not None:
                        await write(data)
                    else:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return None
        except BackendFailed as exc:
            if send.started:
                raise
            down.append(str(exc))
    return unavailable("no decode backend could be reached: " + "; ".join(down))


class _Started:
    """``send`` that notes whether the response has started (a backend failing after
    that cannot be answered with a status any more)."""

    def __init__(self, send: Send) -> None:
        self.raw = send
        self.started = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.raw(message)


async def serve_completion(
    path: str,
    raw: dict[str, Any],
    headers: list[tuple[str, str]],
    send: Send,
    *,
    prefill: Pool,
    decode: Pool,
    probe: bool,
    backend_timeout: float,
    stats: HandoffStats,
    read_at: float,
) -> None:
    """Serve one completion request (the module's three steps and rules); ``headers`` are
    the backend calls' (Rule 3); ``read_at`` is when its body had been read."""
    stats.requests += 1
    call = _Call(path, raw, headers, backend_timeout)
    started = _Started(send)
    try:
        order = decode.order()
        if probe:
            chosen, refusal = await _probe(call, decode)
            if refusal is not None:
                stats.probe_refusals += 1
                await _send_whole(started, refusal)
                return
            assert chosen is not None
            order = [chosen, *(b for b in order if b is not chosen)]
        sent = trio.current_time()
        stats.add("front", sent - read_at)
        step = await _prefill(call, prefill)
        if isinstance(step, ProxyReply):
            if step.status == 503 and b"backend_unavailable" in step.body:
                stats.unavailable += 1
            else:
                stats.passed_refusals += 1
            await _send_whole(started, step)
            return
        backend, params = step
        answered = trio.current_time()
        stats.add("prefill", answered - sent)
        if params is not None:
            call.raw = {**raw, FIELD: params}
            call.held = (backend, params)
        reply = await _decode(call, order, started, stats, answered)
        if reply is not None:
            stats.unavailable += 1
            await _send_whole(started, reply)
    finally:
        await _release(call, stats)


def request_headers(scope: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Rule 3: the client's ``Authorization`` and ``X-Request-Id`` (generated when
    absent), for every backend call of its request."""
    out: list[tuple[str, str]] = []
    request_id = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            out.append(("authorization", value.decode("latin-1")))
        elif name == b"x-request-id" and request_id is None:
            request_id = value.decode("latin-1")
    out.append(("x-request-id", request_id or f"proxy-{uuid.uuid4().hex}"))
    out.append(("content-type", "application/json"))
    return out
