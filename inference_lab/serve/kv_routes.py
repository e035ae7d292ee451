"""The side-channel routes of prefill/decode hand-offs (``docs/disaggregation.md``, "In
serve").

- ``POST /kv_transfer/claim`` and ``POST /kv_transfer/release``, on a prefill server: a
  decode server checks the KV a request's params name before it admits the request, and
  says when it has pulled it (``serve/kv_holds.py``: this simulator's stand-in for
  NIXL's side channel and notification).
- ``GET /kv_transfer/admission?model=NAME``, on any server: whether a request for the
  model would be admitted now, answered as an admission refuses (200, 529 with
  ``Retry-After``, 503), so a proxy can ask a decode server before a prefill is spent on
  a request it would refuse.

Rule 1: the routes pass the gate like the API (the API key when the server has one);
        bodies are read by the strict converter, unknown keys refused (400).
Rule 2: on a server that is not of role ``prefill`` the claim and release routes answer 404
        ``kv_not_found``: it holds no KV.
Rule 3: the admission answer is the snapshot's verdict: a model whose engine is not running
        or sleeps is a 503, one whose waiting places are all taken (``max_waiting`` > 0
        and the places held reach it) a 529; it holds nothing and counts no refusal. With
        one replica it is what an arrival at that instant would get; with several it
        looks at the model's total, not the replica the router would pick.
"""

from __future__ import annotations

from typing import cast

from quart import Response, request
from quart_trio import QuartTrio

from inference_lab.api.kv_transfer import ClaimBody, ReleaseBody
from inference_lab.api.schema import parse_json_object, structure
from inference_lab.errors import ApiError, EngineSleeping, EngineUnavailable, QueueFull
from inference_lab.serve.error_replies import error_reply, json_reply
from inference_lab.serve.kv_holds import KVHolds
from inference_lab.serve.routes import to_response
from inference_lab.serve.state import ServeState

__all__ = ["ADMISSION_PATH", "register_kv_routes"]

#: The admission probe's path (Rule 3).
ADMISSION_PATH = "/kv_transfer/admission"


async def _body() -> bytes:
    return cast(bytes, await request.get_data(cache=False, as_text=False))


def _refusal(exc: Exception) -> Response:
    return to_response(error_reply(exc, method=request.method, path=request.path))


def register_kv_routes(app: QuartTrio, state: ServeState) -> None:
    """Add the side-channel routes (module rules) to ``app``."""

    def holds() -> KVHolds:
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

    @app.post("/kv_transfer/claim")
    async def kv_claim() -> Response:
        try:
            store = holds()
            raw = parse_json_object(await _body())
            answer = store.claim(structure(raw, ClaimBody, strict=True))
        except ApiError as exc:
            return _refusal(exc)
        return to_response(json_reply(answer))

    @app.post("/kv_transfer/release")
    async def kv_release() -> Response:
        try:
            store = holds()
            raw = parse_json_object(await _body())
            answer = store.release(structure(raw, ReleaseBody, strict=True))
        except ApiError as exc:
            return _refusal(exc)
        return to_response(json_reply(answer))

    @app.get(ADMISSION_PATH)
    async def kv_admission() -> Response:
        name = request.args.get("model")
        if name is None:
            return _refusal(ApiError(400, "invalid_value", "model is required", "model"))
        runtime = state.runtimes.get(name)
        if runtime is None:
            return _refusal(state.model_not_found(name))
        snap = runtime.snapshot()
        if not snap.alive:
            return _refusal(EngineUnavailable(name))
        if runtime.sleep_level:
            return _refusal(EngineSleeping(name))
        if snap.max_waiting and snap.depth >= snap.max_waiting:
            return _refusal(QueueFull(name, snap.depth, snap.max_waiting, runtime.retry_after()))
        return to_response(
            json_reply(
                {
                    "model": name,
                    "admits": True,
                    "waiting_places": snap.depth,
                    "max_waiting": snap.max_waiting,
                }
            )
        )
