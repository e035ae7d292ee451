"""Engine control: ``POST /control/engine`` (kill, restart, slowdown of one model).

Rule 1: the route exists only with the harness on; off, the path is an unknown path (404).
Rule 2: ``kill`` and ``slowdown`` act synchronously (no checkpoint between the decision and
        the change); ``restart`` starts a fresh runtime in the app's nursery
        (``restart_runtime`` of the host).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol

import attrs
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from inference_lab.api.schema import parse_json_object
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve.error_replies import Reply, error_reply, json_reply
from inference_lab.serve.harness.host import HarnessHost
from inference_lab.serve.harness.intercept import Harness

__all__ = [
    "ACTIONS",
    "MAX_STEP_TIME_FACTOR",
    "ControlHost",
    "EngineCommand",
    "apply_engine_command",
    "parse_engine_command",
    "register_harness_routes",
]

#: The engine-control actions of ``POST /control/engine``.
ACTIONS = ("kill", "restart", "slowdown")
#: Largest slowdown factor (a step of 10 ms then takes 10 s).
MAX_STEP_TIME_FACTOR = 1000.0


class ControlHost(HarnessHost, Protocol):
    """What the engine-control route needs of the app's serving state: a
    :class:`HarnessHost` and its harness (``ServeState`` is one)."""

    @property
    def harness(self) -> Harness:
        """The app's harness."""


@attrs.frozen(kw_only=True)
class EngineCommand:
    """A validated ``POST /control/engine`` body."""

    model: str
    action: Literal["kill", "restart", "slowdown"]
    factor: float | None = None


def _echo(value: Any) -> str:
    return truncate_echo(json.dumps(value, ensure_ascii=False))


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_value", message, param)


def parse_engine_command(raw: Mapping[str, Any]) -> EngineCommand:
    """Validate ``{"model": M, "action": "kill"|"restart"|"slowdown", "factor": x}``:
    ``factor`` (a number, 0 < x <= :data:`MAX_STEP_TIME_FACTOR`) with ``slowdown`` only;
    unknown keys are errors. Raises :class:`ApiError` 400 ``invalid_value``."""
    for key in raw:
        if key not in ("model", "action", "factor"):
            raise _bad(str(key), f"unknown field {_echo(key)} (allowed: model, action, factor)")
    model, action, factor = raw.get("model"), raw.get("action"), raw.get("factor")
    if type(model) is not str or not model:
        raise _bad("model", "model must be a model name (a non-empty string)")
    if action not in ACTIONS:
        raise _bad("action", f"action must be one of {', '.join(ACTIONS)}, got {_echo(action)}")
    if action != "slowdown":
        if factor is not None:
            raise _bad("factor", "factor applies to action slowdown only")
        return EngineCommand(model=model, action=action)
    # a bool is no number
    number = (
        float(factor) if isinstance(factor, (int, float)) and type(factor) is not bool else math.nan
    )
    if not (0 < number <= MAX_STEP_TIME_FACTOR):
        raise _bad(
            "factor",
            f"factor must be a number > 0 and <= {MAX_STEP_TIME_FACTOR:g}, got {_echo(factor)}",
        )
    return EngineCommand(model=model, action="slowdown", factor=float(number))


async def apply_engine_command(state: HarnessHost, command: EngineCommand) -> ModelRuntime:
    """Carry out ``command`` on its (existing) model; the model's runtime afterwards."""
    runtime = state.runtimes[command.model]
    if command.action == "kill":
        runtime.kill()
    elif command.action == "restart":
        runtime = await state.restart_runtime(command.model)
    else:
        assert command.factor is not None
        runtime.set_step_time_factor(command.factor)
    return runtime


def _response(reply: Reply) -> Response:
    response = Response(reply.body, status=reply.status, content_type=reply.content_type.decode())
    for name, value in reply.headers:
        response.headers[name.decode()] = value.decode()
    return response


def register_harness_routes(app: QuartTrio, state: ControlHost) -> None:
    """Add ``POST /control/engine`` to ``app`` when the harness is on (off, nothing is
    added: the path answers 404 as any unknown path does). The gate's control-token rule
    covers it like every ``/control/*`` path."""
    if not state.harness.enabled:
        return

    @app.post("/control/engine")
    async def control_engine() -> Response:
        try:
            data = await request.get_data(cache=False, as_text=False)
            assert isinstance(data, bytes)
            command = parse_engine_command(parse_json_object(data))
            if command.model not in state.runtimes:
                raise state.model_not_found(command.model)
        except (ApiError, HTTPException) as exc:
            return _response(error_reply(exc, method=request.method, path=request.path))
        runtime = await apply_engine_command(state, command)
        body = {
            "model": runtime.name,
            "action": command.action,
            "alive": runtime.snapshot().alive,
            "step_time_factor": runtime.engine.step_time_factor,
        }
        return _response(json_reply(body))
