"""The Quart routes: health, version, models, metrics, capacity control and statistics.

The completion routes are not here: the app's ASGI connection serves them
(:mod:`inference_lab.serve.completions`). Every answer is built from published runtime
snapshots (or a statistics call) and sent as a :class:`Reply`.

Rule 1: a capacity change is validated whole before anything changes; then it applies to
        every addressed model at once (synchronously: no checkpoint in between).
Rule 2: errors go through :func:`inference_lab.serve.error_replies.error_reply`.
"""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any, cast

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from inference_lab.api.requests import BYTE_TOKENIZER, parse_capacity_request
from inference_lab.api.schema import parse_json_object
from inference_lab.api.tokenize import (
    detokenize_body,
    parse_detokenize_request,
    parse_tokenize_request,
    tokenize_body,
)
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.jsonbytes import dumps
from inference_lab.runtime.model_runtime import ModelRuntime, RuntimeSnapshot
from inference_lab.serve.error_replies import (
    Reply,
    error_reply,
    json_reply,
)
from inference_lab.serve.health import HEALTH_PATH, health_reply
from inference_lab.serve.lora import model_cards
from inference_lab.serve.lora_routes import register_lora_routes
from inference_lab.serve.state import ServeState

__all__ = [
    "capacity_entry",
    "health_reply",
    "model_object",
    "package_version",
    "register_routes",
    "stats_entry",
]


def to_response(reply: Reply) -> Response:
    """A Quart response carrying ``reply`` exactly."""
    response = Response(reply.body, status=reply.status, content_type=reply.content_type.decode())
    for name, value in reply.headers:
        response.headers[name.decode()] = value.decode()
    return response


def capacity_entry(snap: RuntimeSnapshot) -> dict[str, Any]:
    """One model's entry of ``GET /control/capacity``."""
    return {
        "model": snap.model,
        "max_waiting": snap.max_waiting,
        "max_num_seqs": snap.max_num_seqs,
        "waiting": snap.depth,
        "queued": snap.queued,
        "running": snap.running,
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


def stats_entry(runtime: ModelRuntime, last: int | None, finished: int | None) -> dict[str, Any]:
    """One model's entry of ``GET /control/stats``: engine counters, the simulated E2E
    median and the pacing lag (all times in milliseconds)."""
    st = runtime.statistics(last, finished)
    snap, eng = st.snapshot, st.engine
    return {
        "model": snap.model,
        "alive": snap.alive,
        "waiting": snap.depth,
        "queued": snap.queued,
        "running": snap.running,
        "max_num_seqs": snap.max_num_seqs,
        "max_waiting": snap.max_waiting,
        "admitted": snap.admitted,
        "refused": snap.refused,
        "aborted": snap.aborted,
        "sim_time": st.sim_time,
        "wall_time": st.wall_time,
        "steps": eng.steps,
        "finished": eng.finished,
        "preemptions": eng.preemptions,
        "kv_usage": eng.kv_usage,
        "sim_e2e_ms": {"count": st.e2e_count, "p50": _ms(st.e2e_p50)},
        "pacing_lag_ms": {
            "events": snap.events,
            "total": _ms(st.lag.total),
            "mean": _ms(snap.lag_mean),
            "max": _ms(snap.lag_max),
            "window_p50": _ms(st.lag.recent_p50),
            "window_p99": _ms(st.lag.recent_p99),
            "window_max": _ms(st.lag.recent_max),
            "last_second_p99": _ms(st.lag.window_p99),
            "last_second_max": _ms(st.lag.window_max),
            "precise_timer": st.precise_timer,
            "early_wake": _ms(st.calibration.early),
            "early_wake_samples": st.calibration.samples,
        },
    }


def _model_for(state: ServeState, model: str | None) -> ModelRuntime:
    """The runtime a ``/tokenize``-style request names (a LoRA adapter's: its base
    model's); ``model`` may be left out only when one model is served."""
    if model is None:
        if len(state.runtimes) == 1:
            return next(iter(state.runtimes.values()))
        raise ApiError(
            400, "invalid_value", "model is required when more than one model is served", "model"
        )
    runtime = state.runtime_for(model)
    if runtime is None:
        raise state.model_not_found(model)
    return runtime


async def _body() -> bytes:
    return cast(bytes, await request.get_data(cache=False, as_text=False))


def model_object(state: ServeState, runtime: ModelRuntime) -> dict[str, Any]:
    """One model as ``/v1/models`` lists it (vLLM's fields: ``max_model_len`` is the
    deployment's context length)."""
    return {
        "id": runtime.name,
        "object": "model",
        "created": state.created,
        "owned_by": "inference-lab",
        "max_model_len": runtime.deployment.model.max_seq_len,
    }


def package_version() -> str:
    """The installed ``inference-lab`` version (``GET /version``)."""
    try:
        return importlib.metadata.version("inference-lab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


#: The largest ``?last=`` / ``?finished=`` of ``GET /control/stats``.
MAX_COUNT_ARG = 10_000_000


def _count_arg(name: str) -> int | None:
    """``?name=N``: None when absent or empty; else ASCII digits for an integer in
    0..MAX_COUNT_ARG, or a 400 ``invalid_value`` naming the parameter."""
    raw = request.args.get(name, "")
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 8) or int(raw) > MAX_COUNT_ARG:
        raise ApiError(
            400,
            "invalid_value",
            f"{name} must be an integer from 0 to {MAX_COUNT_ARG}, got {truncate_echo(raw)!r}",
            name,
        )
    return int(raw)


def register_routes(app: QuartTrio, state: ServeState) -> None:
    """Add the Quart routes and error handlers of the serve app to ``app``."""
    # Paths match as sent: Werkzeug's slash merging would answer ``//v1//models`` with a
    # redirect whose Location is built from the client's Host (the gate 404s them first).
    app.url_map.merge_slashes = False
    # Quart's body deadline (60 s by default) is the server's (settings.body_timeout);
    # its MAX_CONTENT_LENGTH refuses a body as soon as it passes the limit.
    app.config["BODY_TIMEOUT"] = state.settings.body_timeout
    _register_error_handlers(app)
    _register_model_routes(app, state)
    _register_capacity_routes(app, state)
    _register_token_routes(app, state)
    _register_stats_route(app, state)


def _register_error_handlers(app: QuartTrio) -> None:
    """An HTTP error or an unhandled exception answers in the OpenAI envelope (Rule 2)."""

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        return to_response(error_reply(exc, method=request.method, path=request.path))

    @app.errorhandler(Exception)
    async def _internal_error(exc: Exception) -> Response:
        app.logger.exception("unhandled error", exc_info=exc)
        return to_response(error_reply(exc))


def _register_model_routes(app: QuartTrio, state: ServeState) -> None:
    """``/health``, the model list and cards (LoRA adapters' too, and their load and
    unload routes), ``/version`` and ``/metrics``."""

    @app.get(HEALTH_PATH)
    async def health() -> Response:
        """serve/health.py Rule 2: where the connection did not answer it itself."""
        return to_response(health_reply(state))

    @app.get("/v1/models")
    async def models() -> Response:
        data = [model_object(state, rt) for rt in state.runtimes.values()]
        for rt in state.runtimes.values():  # LoRA adapters, as vLLM lists them
            data += model_cards(rt, state.created)
        return to_response(json_reply({"object": "list", "data": data}))

    @app.get("/v1/models/<path:model_id>")
    async def retrieve_model(model_id: str) -> Response:
        """OpenAI's ``models.retrieve``; ``model_id`` may contain ``/``."""
        runtime = state.runtime_for(model_id)
        if runtime is None:
            return to_response(error_reply(state.model_not_found(model_id)))
        if runtime.name != model_id:  # an adapter's card
            card = next(c for c in model_cards(runtime, state.created) if c["id"] == model_id)
            return to_response(json_reply(card))
        return to_response(json_reply(model_object(state, runtime)))

    register_lora_routes(app, state, to_response)

    version_body = dumps({"version": package_version()})

    @app.get("/version")
    async def version() -> Response:
        return to_response(Reply(200, version_body))

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus exposition of every model (:mod:`inference_lab.serve.metrics`)."""
        body, content_type = await state.metrics.exposition()
        return to_response(Reply(200, body, content_type=content_type.encode()))


def _register_capacity_routes(app: QuartTrio, state: ServeState) -> None:
    """``GET`` and ``POST /control/capacity``: the dials in force, and a change (Rule 1)."""

    @app.get("/control/capacity")
    async def get_capacity() -> Response:
        body = [capacity_entry(rt.snapshot()) for rt in state.runtimes.values()]
        return to_response(json_reply(body))

    @app.post("/control/capacity")
    async def post_capacity() -> Response:
        try:
            change = parse_capacity_request(parse_json_object(await _body()))
            if change.model is None:
                targets = list(state.runtimes.values())
            elif change.model in state.runtimes:
                targets = [state.runtimes[change.model]]
            else:
                raise state.model_not_found(change.model)
        except (ApiError, HTTPException) as exc:
            return to_response(error_reply(exc, method=request.method, path=request.path))
        for runtime in targets:
            runtime.set_capacity(max_num_seqs=change.max_num_seqs, max_waiting=change.max_waiting)
        return to_response(json_reply([capacity_entry(rt.snapshot()) for rt in targets]))


def _register_token_routes(app: QuartTrio, state: ServeState) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize``."""

    @app.post("/tokenize")
    async def tokenize() -> Response:
        """vLLM's ``/tokenize``: the model's tokenizer (or the byte rule) on a prompt or
        on chat messages."""
        try:
            parsed = parse_tokenize_request(parse_json_object(await _body()))
            runtime = _model_for(state, parsed.model)
            tokenizer = state.settings.tokenizers.get(runtime.name, BYTE_TOKENIZER)
            max_len = runtime.deployment.model.max_seq_len
            return to_response(Reply(200, tokenize_body(parsed, tokenizer, max_model_len=max_len)))
        except (ApiError, HTTPException) as exc:
            return to_response(error_reply(exc, method=request.method, path=request.path))

    @app.post("/detokenize")
    async def detokenize() -> Response:
        """vLLM's ``/detokenize``: token ids back to text."""
        try:
            parsed = parse_detokenize_request(parse_json_object(await _body()))
            runtime = _model_for(state, parsed.model)
            tokenizer = state.settings.tokenizers.get(runtime.name, BYTE_TOKENIZER)
            return to_response(Reply(200, detokenize_body(parsed, tokenizer)))
        except (ApiError, HTTPException) as exc:
            return to_response(error_reply(exc, method=request.method, path=request.path))


def _register_stats_route(app: QuartTrio, state: ServeState) -> None:
    """``GET /control/stats``."""

    @app.get("/control/stats")
    async def stats() -> Response:
        """Runtime statistics (not in the OpenAI API). ``?last=N`` computes the lag
        percentiles over the last N engine events, ``?finished=M`` the median simulated
        E2E over the last M completions."""
        try:
            last, finished = _count_arg("last"), _count_arg("finished")
        except ApiError as exc:
            return to_response(error_reply(exc, method=request.method, path=request.path))
        delivery = state.delivery.statistics()
        body = {
            "process": {"cpu_seconds": time.process_time(), "monotonic_seconds": time.monotonic()},
            "delivery": {
                "open_streams": delivery.open_streams,
                "interval_ms": _ms(delivery.interval),
                "loop_busy": round(delivery.loop_busy, 4),
                "holds": delivery.holds,
            },
            "models": [stats_entry(rt, last, finished) for rt in state.runtimes.values()],
        }
        return to_response(json_reply(body))
