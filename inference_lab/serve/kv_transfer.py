"""Prefill/decode disaggregation in ``serve``: vLLM's ``kv_transfer_params`` on the
completion routes, by the server's ``--role`` (``docs/disaggregation.md``, "In serve").

:class:`KVConnector` is a server's part (its role, engine id, held KV on a prefill server:
``serve/kv_holds.py``, pulls on a decode server: ``serve/kv_pulls.py``);
:class:`KVRequest` is one request's, which the completion routes
(``serve/completions.py``, ``serve/agents.py``) consult at fixed points.

Rule 1: a server of role ``both`` ignores ``kv_transfer_params`` (as vLLM without a KV
        connector); ``prefill`` serves ``do_remote_decode`` and ``decode`` serves
        ``do_remote_prefill``; the other role's params are a 400 naming the role. Every
        role serves requests without params as ``both`` does.
Rule 2: a transfer is of one sequence and one prompt: ``n`` > 1, a completions body of
        several prompts, and (``do_remote_decode``) a stream are 400s, checked with the
        body's other fields.
Rule 3: the checks run in the routes' order, then the decode side's claim comes last
        before admission (after fit, the work cap and the shutdown check, before engine
        alive and depth): ... fit (400) -> claim (400 / 404 / 503) -> alive (503) -> depth
        (529). A claim made is released whatever follows (``serve/kv_pulls.py`` Rule 3).
Rule 4: a prefill request is admitted with ``hold_kv``; its hold is registered by its sink
        when it finishes (``serve/kv_holds.py`` Rule 1) and its answer carries the params
        a decode server needs (:func:`~inference_lab.api.kv_transfer.remote_prefill_params`:
        this server's engine id, the hold's id and block ids, the host and port the
        request came in on, the deployment's tp); an answer not delivered ends the hold.
Rule 5: a decode request is admitted with ``remote_positions`` =
        ``remote_positions(prompt, block_size)`` (the prompt's full blocks short of its
        last position); the engine prices and paces the transfer, then computes the rest
        of the prompt.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import trio

from inference_lab.api.kv_transfer import (
    FIELD,
    RemoteDecode,
    RemotePrefill,
    check_blocks,
    parse_kv_transfer_params,
    remote_prefill_params,
    with_field,
)
from inference_lab.api.requests import ParsedRequest
from inference_lab.core.engine import Finished
from inference_lab.core.engine.handoff import remote_positions
from inference_lab.errors import ApiError
from inference_lab.runtime.model_runtime import ModelRuntime, RequestHandle
from inference_lab.serve.kv_holds import Hold, KVHolds
from inference_lab.serve.kv_pulls import KVPulls, Peers, Pull
from inference_lab.serve.settings import ServeSettings
from inference_lab.serve.streaming import CollectSink
from inference_lab.serve.transport import SideChannel

__all__ = ["HoldingSink", "KVConnector", "KVRequest"]


class KVConnector:
    """A server's side of the hand-offs: its role and, by role, its held KV or its pulls.
    Built with the app's state; :meth:`run` starts its background task."""

    def __init__(
        self,
        settings: ServeSettings,
        runtimes: Mapping[str, ModelRuntime],
        peers: Peers | None = None,
    ) -> None:
        self.role = settings.role
        self.engine_id = settings.kv_engine_id or f"inference-lab-{uuid.uuid4()}"
        self.holds: KVHolds | None = None
        self.pulls: KVPulls | None = None
        self._side_channel: SideChannel | None = None
        if self.role == "prefill":
            self.holds = KVHolds(
                self.engine_id,
                settings.kv_hold_timeout,
                runtimes.get,
                {d.model.name: d.scheduler.block_size for d in settings.deployments},
            )
        elif self.role == "decode":
            if peers is None:
                self._side_channel = peers = SideChannel()
            self.pulls = KVPulls(peers, allowed=settings.kv_peers, api_key=settings.api_key)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The role's background task (expiry, or releases); runs until cancelled."""
        try:
            if self.holds is not None:
                await self.holds.run(task_status=task_status)
            elif self.pulls is not None:
                await self.pulls.run(task_status=task_status)
            else:
                task_status.started()
        finally:
            if self._side_channel is not None:
                self._side_channel.close()

    def request(self, raw: Mapping[str, Any], batch: Sequence[ParsedRequest]) -> KVRequest | None:
        """The transfer a validated body asks of this server (Rules 1-2), or None; raises
        :class:`ApiError` 400."""
        if self.role == "both" or FIELD not in raw:
            return None
        params = parse_kv_transfer_params(raw)
        if params is None:
            return None
        wanted = "prefill" if isinstance(params, RemoteDecode) else "decode"
        if wanted != self.role:
            flag = "do_remote_decode" if wanted == "prefill" else "do_remote_prefill"
            raise ApiError(
                400,
                "invalid_value",
                f"this server's role is {self.role}: {flag} is served by a server of role "
                f"{wanted} (inference-lab serve --role {wanted})",
                f"{FIELD}.{flag}",
            )
        parsed = batch[0]
        if len(batch) > 1:
            raise ApiError(
                400, "invalid_value", f"{FIELD} needs a single prompt, not {len(batch)}", "prompt"
            )
        if parsed.n != 1:
            raise ApiError(400, "invalid_value", f"{FIELD} needs n = 1, got {parsed.n}", "n")
        if isinstance(params, RemoteDecode) and parsed.stream:
            raise ApiError(
                400,
                "invalid_value",
                "do_remote_decode needs stream: false (the answer's body carries the "
                f"{FIELD} a decode server needs)",
                "stream",
            )
        return KVRequest(self, params)


class HoldingSink(CollectSink):
    """A prefill request's sink: when it finishes, its held KV is registered at once, on
    the engine task (Rule 4; ``serve/kv_holds.py`` Rule 1)."""

    __slots__ = ("kv", "runtime", "request_id")

    def __init__(self, kv: KVRequest, runtime: ModelRuntime, request_id: str) -> None:
        super().__init__()
        self.kv = kv
        self.runtime = runtime
        self.request_id = request_id

    def on_finished(self, finished: Finished) -> None:
        holds = self.kv.connector.holds
        assert holds is not None
        self.kv.hold = holds.hold(self.runtime, finished, self.request_id)
        super().on_finished(finished)


class KVRequest:
    """One request's part in a hand-off (the module rules), consulted by its route: before
    admission (:meth:`begin`, :meth:`admission`), at admission (:meth:`bind`,
    :meth:`sink`), for its answer (:meth:`body`, :meth:`pieces`) and when it ends
    (:meth:`close`, synchronous)."""

    def __init__(self, connector: KVConnector, params: RemoteDecode | RemotePrefill) -> None:
        self.connector = connector
        self.params = params
        self.positions = 0
        self.pull: Pull | None = None
        self.hold: Hold | None = None
        self.host = ("127.0.0.1", 0)
        self.tp = 1
        self.delivered = False

    async def begin(
        self,
        runtime: ModelRuntime,
        prompt_tokens: int,
        scope: Mapping[str, Any],
    ) -> None:
        """Just before admission (Rule 3): on a decode server, check the blocks and claim
        the KV (raises :class:`ApiError`); on a prefill server, note where this request
        came in (the host and port the answer names)."""
        dep = runtime.deployment
        if isinstance(self.params, RemoteDecode):
            server = scope.get("server")
            if server and len(server) >= 2 and server[1] is not None:
                self.host = (str(server[0]), int(server[1]))
            self.tp = dep.hardware.tp
            return
        pulls = self.connector.pulls
        assert pulls is not None
        block_size = dep.scheduler.block_size
        check_blocks(self.params, prompt_tokens, block_size)
        pulls.check_peer(self.params)
        self.pull = await pulls.claim(self.params, runtime.name, prompt_tokens)
        self.positions = remote_positions(prompt_tokens, block_size)

    def admission(self) -> dict[str, Any]:
        """``admit_nowait``'s keyword arguments for this request (Rules 4-5)."""
        if isinstance(self.params, RemoteDecode):
            return {"hold_kv": True}
        return {"remote_positions": self.positions}

    def sink(self, runtime: ModelRuntime, request_id: str) -> CollectSink:
        """A non-streaming request's sink: on a prefill server, one that registers the
        hold (Rule 4)."""
        if isinstance(self.params, RemoteDecode):
            return HoldingSink(self, runtime, request_id)
        return CollectSink()

    def bind(self, handle: RequestHandle) -> None:
        """Right after admission: a decode request's pull is released when its KV arrives
        (at once when nothing is sent)."""
        pull = self.pull
        if pull is None:
            return
        pulls = self.connector.pulls
        assert pulls is not None
        if not self.positions:
            pulls.release(pull)
        else:
            handle.on_kv_arrived = lambda: pulls.release(pull)

    def _answer_params(self) -> dict[str, Any] | None:
        hold = self.hold
        if hold is None:
            return None
        return remote_prefill_params(
            engine_id=self.connector.engine_id,
            request_id=hold.request_id,
            block_ids=hold.block_ids,
            host=self.host[0],
            port=self.host[1],
            tp_size=self.tp,
            num_tokens=hold.prompt_tokens,
        )

    def body(self, body: bytes) -> bytes:
        """A prefill answer's body with its ``kv_transfer_params`` (Rule 4)."""
        params = self._answer_params()
        return body if params is None else with_field(body, FIELD, params)

    def pieces(self, pieces: Iterator[bytes]) -> Iterator[bytes]:
        """:meth:`body` for an answer sent in pieces (the last piece ends the object)."""
        params = self._answer_params()
        if params is None:
            yield from pieces
            return
        last: bytes | None = None
        for piece in pieces:
            if last is not None:
                yield last
            last = piece
        yield with_field(last or b"{}", FIELD, params)

    def close(self) -> None:
        """The request's exchange ended (synchronous, idempotent): a claim not yet released
        is, and a hold whose answer was not delivered ends (Rules 3-4)."""
        pulls = self.connector.pulls
        if self.pull is not None and pulls is not None:
            pulls.release(self.pull)
        holds = self.connector.holds
        if self.hold is not None and holds is not None and not self.delivered:
            holds.end(self.hold, "undelivered")
