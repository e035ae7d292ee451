"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, as vLLM serves them
(:mod:`inference_lab.serve.lora` Rule 2; docs/lora.md).

Rule 1: the routes exist only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (vLLM's gate);
        their answers are vLLM's: the success sentence as plain text, 400
        ``InvalidUserInput`` for a missing field or a name loaded already, 404
        ``NotFoundError`` for unloading a name not loaded, in the OpenAI envelope.
Rule 2: loading past ``max_cpu_loras`` succeeds (the host cache drops its least recently
        used adapter, as vLLM's LRU cache does); unloading an adapter in use succeeds: its
        admitted requests finish with it, new ones naming it get the 404 of an unknown
        model.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from inference_lab.api.schema import parse_json_object
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve.error_replies import Reply, error_reply
from inference_lab.serve.state import ServeState

__all__ = ["register_lora_routes"]

#: the success bodies (vLLM answers a plain string)
TEXT = b"text/plain; charset=utf-8"


def adapter_error(status: int, message: str, type_: str) -> ApiError:
    """An error of the runtime routes (Rule 2), in the OpenAI envelope with vLLM's type."""
    code = "lora_adapter_not_found" if status == 404 else "invalid_user_input"
    return ApiError(status, code, message, "lora_name", type_)


def _load(state: ServeState, raw: dict[str, Any]) -> Reply:
    """``POST /v1/load_lora_adapter`` (Rule 2): ``lora_name`` and ``lora_path``; here an
    optional ``rank`` and ``base_model_name`` (the model it adapts: the first LoRA model)."""
    name, path = raw.get("lora_name"), raw.get("lora_path")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise adapter_error(
            400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
        )
    rank = raw.get("rank", 0)
    if type(rank) is not int or rank < 0:
        raise ApiError(400, "invalid_value", "rank must be an integer >= 1", "rank")
    base = raw.get("base_model_name")
    runtime = _lora_runtime(state, base if isinstance(base, str) else None)
    if state.runtime_for(name) is not None and not raw.get("load_inplace"):
        raise adapter_error(
            400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
        )
    engine = runtime.engine
    if raw.get("load_inplace") and engine.adapters is not None and name in engine.adapters.by_name:
        engine.unload_adapter(name)
    try:
        engine.load_adapter(name, path, rank, runtime.name)
    except ValueError as exc:
        raise adapter_error(400, str(exc), "BadRequestError") from None
    return Reply(
        200, f"Success: LoRA adapter '{name}' added successfully.".encode(), content_type=TEXT
    )


def _unload(state: ServeState, raw: dict[str, Any]) -> Reply:
    """``POST /v1/unload_lora_adapter`` (Rule 2): ``lora_name`` (or ``lora_int_id``)."""
    name, int_id = raw.get("lora_name"), raw.get("lora_int_id")
    if not name and not int_id:
        raise adapter_error(
            400, "either 'lora_name' and 'lora_int_id' needs to be provided.", "InvalidUserInput"
        )
    for rt in state.runtimes.values():
        adapters = rt.engine.adapters
        if adapters is None:
            continue
        for a in list(adapters.by_name.values()):
            if a.name == name or (not name and a.id == int_id):
                rt.engine.unload_adapter(a.name)
                return Reply(
                    200,
                    f"Success: LoRA adapter '{a.name}' removed successfully.".encode(),
                    content_type=TEXT,
                )
    shown = truncate_echo(str(name if name else int_id))
    raise adapter_error(404, f"The lora adapter '{shown}' cannot be found.", "NotFoundError")


def _lora_runtime(state: ServeState, base: str | None) -> ModelRuntime:
    """The model a loaded adapter adapts: ``base`` if given, else the first model with
    LoRA enabled."""
    for rt in state.runtimes.values():
        if rt.engine.adapters is not None and base in (None, rt.name):
            return rt
    if base is not None and base in state.runtimes:
        raise ApiError(400, "invalid_value", f"LoRA is not enabled for '{base}'", "base_model_name")
    if base is not None:
        raise state.model_not_found(base)
    raise ApiError(400, "invalid_value", "LoRA is not enabled (--enable-lora)", None)


def register_lora_routes(
    app: QuartTrio, state: ServeState, respond: Callable[[Reply], Response]
) -> None:
    """Rule 2: the runtime routes, only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``;
    ``respond`` turns a reply into Quart's response (the routes' ``to_response``)."""
    if not state.settings.lora_updating:
        return
    for path, handler in (("/v1/load_lora_adapter", _load), ("/v1/unload_lora_adapter", _unload)):
        app.add_url_rule(path, path, _route(state, handler, respond), methods=["POST"])


def _route(
    state: ServeState,
    handler: Callable[[ServeState, dict[str, Any]], Reply],
    respond: Callable[[Reply], Response],
) -> Callable[[], Awaitable[Response]]:
    async def view() -> Response:
        try:
            body = cast(bytes, await request.get_data(cache=False, as_text=False))
            reply = handler(state, parse_json_object(body))
        except (ApiError, HTTPException) as exc:
            reply = error_reply(exc, method=request.method, path=request.path)
        return respond(reply)

    return view
