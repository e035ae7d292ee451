"""The project's one error hierarchy.

Each class says who raises it and what the caller should do. Errors are mapped to HTTP in
exactly one place (:mod:`inference_lab.serve.error_replies`); CLIs print ``str(error)`` on one
line and exit with the code of their documented policy (:mod:`inference_lab.cli`).
"""

from __future__ import annotations

from inference_lab.jsonbytes import dumps

#: Echoed client values (a model name, a stop string) are cut to this many characters.
MAX_ECHO_CHARS = 256


def truncate_echo(value: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``value`` as it may be echoed in an error message: at most ``limit`` characters,
    the cut marked with an ellipsis, so a 1 MB model name gives a short reply. Called by
    the HTTP layer wherever a message quotes what the client sent."""
    if len(value) <= limit:
        return value
    return value[: limit - 1] + "\u2026"


def error_body(message: str, type_: str, code: str, param: str | None) -> bytes:
    """The OpenAI error envelope, compact, key order message/type/param/code. Never fails
    to encode: a lone surrogate in the message is written as its JSON escape."""
    envelope = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return dumps(envelope)


class InferenceLabError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(InferenceLabError):
    """Raised by :mod:`inference_lab.core.config` for a file that cannot be used.

    ``str(error)`` is one line naming the file and the key path, e.g.
    ``configs/gpt-oss-20b.toml: scheduler.max_num_seqs: must be >= 1, got 0``.
    Callers print it and stop; nothing was loaded.
    """


class CalibrationError(InferenceLabError):
    """Raised by :mod:`inference_lab.calibrate.fit` for a fit the measurements cannot
    determine (fewer measured values than terms, a term nothing moves, two terms that
    move everything alike). ``inference-lab calibrate`` prints it on one line, exit 1."""


class SimError(InferenceLabError):
    """Raised by :func:`inference_lab.sim.run.run_simulation` for a workload that cannot make
    progress on the deployment (every request refused in a duration-bounded closed loop).
    The ``sim`` command prints it on one line and exits 1."""


class RequestRefused(InferenceLabError):
    """Raised by :meth:`Engine.submit` (and returned by ``check_fits``) for a request that
    can never run on the deployment.

    ``limit`` names the limit (``max_seq_len``, ``kv_cache`` or ``batch_tokens``) and
    ``reason`` says which limit and both numbers. The serving layer answers 400
    ``context_length_exceeded``; the offline simulator counts the request as refused.
    """

    def __init__(self, limit: str, reason: str) -> None:
        super().__init__(reason)
        self.limit = limit
        self.reason = reason


class ApiError(InferenceLabError):
    """A request the HTTP layer refuses before any response starts.

    Raised by the ``parse_*`` functions of :mod:`inference_lab.api` (and by the serve app
    for unknown models and fit failures); the serve app turns it into ``status`` +
    :meth:`body`.
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = type_

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


class EngineUnavailable(InferenceLabError):
    """Raised by :meth:`ModelRuntime.admit_nowait` when the model's engine task is not
    running (crashed, stopped or not started). The HTTP app answers 503
    ``engine_unavailable``; the request never entered the engine."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The engine for model '{model}' is not running.")
        self.model = model


class QueueFull(InferenceLabError):
    """Raised by :meth:`ModelRuntime.admit_nowait` when a request has neither a seat in the
    running batch nor a waiting place (``depth >= max_waiting``). The HTTP app answers 529
    ``queue_saturated`` with ``Retry-After: retry_after`` before any response starts;
    nothing was queued."""

    def __init__(self, model: str, depth: int, max_waiting: int, retry_after: int = 1) -> None:
        super().__init__(
            f"Server is at capacity: {depth} requests waiting (max_waiting = {max_waiting}). "
            "Retry with reduced concurrency."
        )
        self.model = model
        self.depth = depth
        self.max_waiting = max_waiting
        self.retry_after = retry_after


class EngineSleeping(EngineUnavailable):
    """Raised by :meth:`ModelRuntime.admit_nowait` while the model sleeps (vLLM's sleep
    mode, ``POST /sleep``): an unavailable engine that ``POST /wake_up`` brings back. The
    HTTP app answers 503 ``engine_sleeping``."""

    def __init__(self, model: str) -> None:
        InferenceLabError.__init__(
            self,
            f"The engine for model '{model}' is sleeping (POST /sleep): wake it with POST /wake_up.",
        )
        self.model = model
