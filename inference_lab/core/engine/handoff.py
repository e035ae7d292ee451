"""Prefill/decode hand-offs: a request prefilled in one pool and decoded in another.

With a deployment's ``[disaggregation]`` (``docs/disaggregation.md``) the engine runs two
pools of workers. :class:`Handoffs` carries each request from one to the other, as vLLM's
NixlConnector and the proxies in front of it do:

Rule 1: a submitted request is first a *prefill request* on the prefill pool: its prompt
        with ``max_tokens = 1``, holding its KV when it finishes (scheduler Rule 6). Its
        sampled token is not the client's: the prefill pool's tokens are not reported.
Rule 2: when its prefill ends at ``t``, a *decode request* of the same id is filed as an
        arrival at ``t + handoff_latency`` on the decode pool, carrying as remote
        positions the prompt's full blocks short of its last position (``((P - 1) //
        block_size) * block_size``: the partial last block, and always the last position,
        are computed where it decodes, as vLLM's decode side re-prefills them).
Rule 3: a decode worker that takes a decode request's blocks starts its transfer: the KV
        bytes of the remote positions it has not cached itself (its own prefix hits are not
        sent), priced by the link (``Disaggregation.transfer_seconds``; with ``overlap``,
        behind the prefill's last step). When it ends, the prefill request's blocks are
        released and the decode request is admitted for the rest of its prompt, emitting
        its first token -- the client's -- at the end of that step.
Rule 4: the ``Finished`` of a hand-off is the decode request's, with the prefill's arrival,
        first scheduling, cached tokens and preemptions, its prefill replica, the end of
        its prefill and of its transfer, and the bytes that crossed the link.
Rule 5: an abort frees both sides wherever they are (the held prefill blocks included).
"""

from __future__ import annotations

import attrs

from inference_lab.core.config import Deployment, Disaggregation
from inference_lab.core.engine.outputs import Finished, finished_record
from inference_lab.core.engine.request import HELD, Request, RequestSpec
from inference_lab.core.engine.scheduler import Scheduler

__all__ = ["Handoff", "Handoffs", "remote_positions"]


def remote_positions(prompt: int, block_size: int) -> int:
    """The positions whose KV a prefill sends for a prompt of ``prompt`` tokens (Rule 2)."""
    return ((prompt - 1) // block_size) * block_size


@attrs.define(slots=True)
class Handoff:
    """One request's way through the two pools (Rules 1-4)."""

    max_tokens: int
    target: int
    arrival_time: float = 0.0
    prefill: Request | None = None
    prefill_worker: int = -1
    prefill_end: float = -1.0
    #: the duration of the step that ended its prefill (what an overlapped transfer hides)
    prefill_step: float = 0.0
    transfer_end: float = -1.0
    transfer_bytes: float = 0.0
    first_scheduled: float = -1.0
    cached_tokens: int = 0
    preemptions: int = 0


class Handoffs:
    """The hand-offs in flight, and the transfers' totals."""

    __slots__ = ("split", "decode_dep", "records")

    def __init__(self, split: Disaggregation) -> None:
        self.split = split
        self.decode_dep: Deployment = split.decode
        self.records: dict[int, Handoff] = {}

    def prefill_spec(self, request_id: int, spec: RequestSpec) -> RequestSpec:
        """The prefill request of a submitted ``spec`` (Rule 1), its record kept."""
        target = spec.max_tokens if spec.target is None else spec.target
        self.records[request_id] = Handoff(max_tokens=spec.max_tokens, target=target)
        return attrs.evolve(spec, max_tokens=1, target=1, hold_kv=True, worker=None)

    def prefill_done(
        self, w: Scheduler, r: Request, now: float, step: float
    ) -> tuple[RequestSpec, float]:
        """``r``'s prefill ended at ``now`` on ``w`` (the step took ``step`` s): the decode
        request's spec and its arrival time (Rule 2)."""
        record = self.records[r.id]
        record.arrival_time = r.arrival_time
        record.prefill = r
        record.prefill_worker = w.index
        record.prefill_end = now
        record.prefill_step = step
        record.first_scheduled = r.first_scheduled_time
        record.cached_tokens = r.cached_tokens
        record.preemptions = r.preemptions
        bs = self.decode_dep.scheduler.block_size
        spec = RequestSpec(
            prompt_tokens=r.prompt_tokens,
            max_tokens=record.max_tokens,
            target=record.target,
            priority=r.priority,
            block_hashes=r.block_hashes,
            remote_positions=remote_positions(r.prompt_tokens, bs),
        )
        return spec, now + self.split.handoff_latency

    def transfer(self, r: Request) -> tuple[float, float]:
        """A decode worker took ``r``'s blocks: the bytes its transfer moves and the
        seconds it takes (Rule 3)."""
        dep = self.decode_dep
        sent = dep.kv_bytes_of(r.remote_positions) - dep.kv_bytes_of(r.num_computed)
        record = self.records.get(r.id)
        overlapped = record.prefill_step if record is not None else 0.0
        if record is not None:
            record.transfer_bytes = sent
        return sent, self.split.transfer_seconds(sent, overlapped)

    def transfer_done(self, r: Request, now: float) -> Request | None:
        """``r``'s KV arrived at ``now``: the prefill request whose blocks go back (Rule 3)."""
        record = self.records.get(r.id)
        if record is None:
            return None
        record.transfer_end = now
        held = record.prefill
        record.prefill = None
        return held if held is not None and held.status == HELD else None

    def report(self, r: Request, now: float, worker: int, frontend: float) -> Finished:
        """The ``Finished`` of a hand-off whose decode request ``r`` ended at ``now``."""
        record = self.records.pop(r.id)
        arrival = record.arrival_time
        return finished_record(
            request_id=r.id,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.num_output,
            finish_reason="length" if r.num_output >= r.max_tokens else "stop",
            arrival_time=arrival - frontend if frontend else arrival,
            first_scheduled_time=record.first_scheduled,
            first_token_time=r.first_token_time,
            finish_time=now,
            preemptions=record.preemptions + r.preemptions,
            n=r.n,
            cached_tokens=record.cached_tokens,
            worker=worker,
            prefill_worker=record.prefill_worker,
            prefill_end_time=record.prefill_end,
            transfer_end_time=record.transfer_end
            if record.transfer_end >= 0
            else record.prefill_end,
            transfer_bytes=record.transfer_bytes,
        )

    def abort(self, request_id: int) -> Request | None:
        """Forget ``request_id``'s hand-off: its held prefill request, if any (Rule 5)."""
        record = self.records.pop(request_id, None)
        if record is None or record.prefill is None or record.prefill.status != HELD:
            return None
        return record.prefill
