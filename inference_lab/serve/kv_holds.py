"""A prefill server's held KV (``serve --role prefill``): the requests that finished with
their blocks kept for a decode server, how a decode server claims and releases them, and
their expiry.

vLLM's NixlConnector keeps a ``do_remote_decode`` request's blocks after it finishes
until the decode side has read them and notified it, or until
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (480 s) passes. NIXL's notification has no HTTP form;
this server's stand-in is two small routes a decode server calls on the host and port the
answer named (``serve/kv_routes.py``): ``POST /kv_transfer/claim`` before it admits the
request (the params are checked against what is held here, the only place that knows),
and ``POST /kv_transfer/release`` once the KV has arrived (or its request ended).

Rule 1: a hold is registered synchronously when its request finishes (on the engine
        task, from its sink), so no moment exists in which its blocks are held and not
        known here; its id is the answer's request id (another, unique, one if that is
        already held) and its block ids are fresh numbers, one per block the prompt fills,
        never reused by this server.
Rule 2: every hold ends exactly once, and its blocks go back to its engine then
        (``ModelRuntime.release_kv``): released by a decode server, expired
        ``kv_hold_timeout`` seconds after its request finished (claimed or not, as vLLM's
        timer runs), undelivered (its answer never reached its client, so nobody can
        name it), or stopped (its engine stopped: a claim finds it gone). Each end is
        counted by reason, per model.
Rule 3: a claim names this server's engine id, a held request, exactly its block ids, its
        model and its prompt's length; anything else is refused (404 when no such KV is
        held here, 400 when the request does not match it) and counted. A hold is claimed
        at most once; its runtime must still be the one serving the model (a restarted
        engine holds nothing).
Rule 4: expiry is one task: holds end in the order they were made (their deadlines are in
        that order), and the task sleeps until the oldest one's deadline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from inference_lab.api.encoding import random_hex
from inference_lab.api.kv_transfer import (
    ClaimBody,
    ReleaseBody,
    prompt_blocks,
)
from inference_lab.core.engine import Finished
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.runtime.model_runtime import ModelRuntime

__all__ = ["END_REASONS", "Hold", "HoldCounts", "KVHolds"]

#: Why a hold ended (Rule 2), as ``/metrics`` labels them.
END_REASONS = ("released", "expired", "undelivered", "stopped")


@attrs.define(eq=False, kw_only=True)
class Hold:
    """One finished request's KV, held for a decode server."""

    request_id: str
    model: str
    runtime: ModelRuntime
    engine_request: int
    prompt_tokens: int
    block_ids: tuple[int, ...]
    #: trio time at which it expires
    deadline: float
    claimed: bool = False


@attrs.define
class HoldCounts:
    """A model's holds: made, ended by reason, and claims refused (Rules 2-3)."""

    held: int = 0
    ended: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(END_REASONS, 0))
    claims: int = 0
    claims_refused: int = 0


def _not_found(message: str) -> ApiError:
    return ApiError(404, "kv_not_found", message, "kv_transfer_params")


def _mismatch(message: str) -> ApiError:
    return ApiError(400, "invalid_value", message, "kv_transfer_params")


class KVHolds:
    """The holds of one prefill server (the module rules). ``live_runtime(model)`` is the
    runtime serving ``model`` now (None: not served)."""

    def __init__(
        self,
        engine_id: str,
        timeout: float,
        live_runtime: Callable[[str], ModelRuntime | None],
        models: Mapping[str, int],
    ) -> None:
        self.engine_id = engine_id
        self.timeout = timeout
        self._live_runtime = live_runtime
        #: model -> its block size
        self._block_size = dict(models)
        self._holds: dict[str, Hold] = {}
        self._order: deque[Hold] = deque()
        self._next_block = 1
        self._wake = trio.Event()
        self.counts = {model: HoldCounts() for model in models}

    # ------------------------------------------------------------------ Rule 1
    def hold(self, runtime: ModelRuntime, finished: Finished, request_id: str) -> Hold:
        """Register the KV ``finished`` (of ``runtime``'s model) holds; synchronous."""
        model = runtime.name
        key = request_id if request_id not in self._holds else f"{request_id}-{random_hex()}"
        blocks = prompt_blocks(finished.prompt_tokens, self._block_size[model])
        first = self._next_block
        self._next_block += blocks
        hold = Hold(
            request_id=key,
            model=model,
            runtime=runtime,
            engine_request=finished.request_id,
            prompt_tokens=finished.prompt_tokens,
            block_ids=tuple(range(first, first + blocks)),
            deadline=trio.current_time() + self.timeout,
        )
        self._holds[key] = hold
        self._order.append(hold)
        self.counts[model].held += 1
        self._wake.set()
        return hold

    def held(self, model: str) -> int:
        """Holds of ``model`` now."""
        return sum(1 for hold in self._holds.values() if hold.model == model)

    # ------------------------------------------------------------------ Rule 2
    def end(self, hold: Hold, reason: str) -> bool:
        """End ``hold`` for ``reason`` (one of :data:`END_REASONS`): its blocks go back.
        False when it had ended already."""
        if self._holds.get(hold.request_id) is not hold:
            return False
        del self._holds[hold.request_id]
        hold.runtime.release_kv(hold.engine_request)  # (a stopped runtime holds nothing)
        self.counts[hold.model].ended[reason] += 1
        return True

    # ------------------------------------------------------------------ Rule 3
    def claim(self, body: ClaimBody) -> dict[str, Any]:
        """The answer to a decode server's claim, or :class:`ApiError` (Rule 3)."""
        counts = self.counts.get(body.model)
        try:
            hold = self._find(body.remote_engine_id, body.remote_request_id)
            self._match(hold, body)
        except ApiError:
            if counts is not None:
                counts.claims_refused += 1
            raise
        hold.claimed = True
        self.counts[hold.model].claims += 1
        return {
            "remote_request_id": hold.request_id,
            "prompt_tokens": hold.prompt_tokens,
            "blocks": len(hold.block_ids),
        }

    def release(self, body: ReleaseBody) -> dict[str, Any]:
        """A decode server pulled the KV (or gave it up): the hold ends (Rule 2)."""
        hold = self._find(body.remote_engine_id, body.remote_request_id)
        self.end(hold, "released")
        return {"released": True, "remote_request_id": hold.request_id}

    def _find(self, engine_id: str, request_id: str) -> Hold:
        if engine_id != self.engine_id:
            raise _not_found(
                f"this prefill server's engine is {self.engine_id!r}, not "
                f"{truncate_echo(engine_id)!r}: the KV is held elsewhere"
            )
        hold = self._holds.get(request_id)
        if hold is None:
            raise _not_found(
                f"no KV is held for request {truncate_echo(request_id)!r}: never held here, "
                f"already pulled, or expired ({self.timeout:g} s after its prefill)"
            )
        if self._live_runtime(hold.model) is not hold.runtime or not hold.runtime.snapshot().alive:
            self.end(hold, "stopped")
            raise _not_found(
                f"the engine that held request {hold.request_id!r}'s KV has stopped: its KV is gone"
            )
        return hold

    def _match(self, hold: Hold, body: ClaimBody) -> None:
        if body.model != hold.model:
            raise _mismatch(
                f"request {hold.request_id!r}'s KV is {hold.model!r}'s, not "
                f"{truncate_echo(body.model)!r}'s"
            )
        if tuple(body.remote_block_ids) != hold.block_ids:
            raise _not_found(
                f"the block ids named are not those held for request {hold.request_id!r} "
                f"({len(hold.block_ids)} blocks from {hold.block_ids[0]})"
            )
        if body.prompt_tokens != hold.prompt_tokens:
            raise _mismatch(
                f"request {hold.request_id!r}'s KV is of a {hold.prompt_tokens}-token "
                f"prompt; this request's prompt is {body.prompt_tokens} tokens"
            )
        if hold.claimed:
            raise _not_found(
                f"request {hold.request_id!r}'s KV is already being pulled by another "
                "decode request"
            )

    # ------------------------------------------------------------------ Rule 4
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """End every hold at its deadline (Rule 4); runs until cancelled."""
        task_status.started()
        order = self._order
        while True:
            while order and self._holds.get(order[0].request_id) is not order[0]:
                order.popleft()  # ended already
            if not order:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            head = order[0]
            if trio.current_time() >= head.deadline:
                order.popleft()
                self.end(head, "expired")
                continue
            await trio.sleep_until(head.deadline)
