"""What the engine reports: frozen values built by the engine only.

Rule 1: every value here is immutable; the serving layer and the simulator read them
        (``Finished`` per request, ``StepEvents`` per handled event, ``StepInfo`` per
        batch, the statistics snapshots).
"""

from __future__ import annotations

from array import array
from typing import Protocol

import attrs

from inference_lab.core.builders import frozen_builder

__all__ = [
    "EngineStatistics",
    "Finished",
    "QueueView",
    "StepEvents",
    "StepInfo",
    "StepLog",
    "TierStatistics",
    "WorkerStatistics",
    "engine_statistics",
]


@attrs.frozen(kw_only=True)
class Finished:
    """A completed request, reported at its finish time (the end of its last step).

    ``output_tokens`` is the count of each of its ``n`` sequences (they finish together);
    the request produced ``n * output_tokens`` tokens in all. ``cached_tokens`` is the
    prompt prefix its worker had cached when it was first admitted (not computed by
    it); ``worker`` the replica that ran it.

    With prefill/decode disaggregation (``docs/disaggregation.md``): ``prefill_worker``
    the prefill replica (-1: none), ``prefill_end_time`` when its prefill ended there,
    ``transfer_end_time`` when its KV had reached ``worker`` (-1.0: not so run), and
    ``transfer_bytes`` the bytes that crossed the link.
    """

    request_id: int
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_time: float
    preemptions: int
    n: int = 1
    cached_tokens: int = 0
    worker: int = 0
    prefill_worker: int = -1
    prefill_end_time: float = -1.0
    transfer_end_time: float = -1.0
    transfer_bytes: float = 0.0


@attrs.frozen(kw_only=True)
class StepInfo:
    """The batch that started at a boundary on one worker.

    ``num_seqs`` counts sequences in the batch (a group's shared prefill is one, its
    decode ``n``); ``num_tokens`` the positions computed; ``kv_usage`` the worker's used
    fraction of KV blocks after the batch was chosen; ``flop_util`` / ``bw_util`` the
    compute and memory parts of the step's roofline time; ``preempted`` how many requests
    were preempted to make room. A lockstep step of data-parallel attention ranks is one
    ``StepInfo`` (``worker`` its first rank; sums over the ranks; ``kv_usage`` over their
    blocks).

    With speculative decoding: ``drafts`` the sequences that verified draft tokens,
    ``draft_tokens`` those tokens, ``accepted_tokens`` the accepted ones and
    ``accepted_per_position`` how many drafts accepted position ``j`` (vLLM's counters);
    ``plain_duration`` how long the step's tokens would take without speculation: the
    same batch without drafts (no verify width, no drafter), then ``accepted_tokens /
    drafts`` more steps of one position per drafting sequence -- the speed-up
    estimate's reference. All 0 / empty otherwise.
    """

    worker: int
    start: float
    duration: float
    num_seqs: int
    num_tokens: int
    kv_usage: float
    flop_util: float
    bw_util: float
    preempted: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    plain_duration: float = 0.0


@attrs.frozen(kw_only=True)
class StepEvents:
    """What became visible at ``time``: tokens emitted (request id, count; a group's count
    is what each of its sequences emitted), completions (their last token is in
    ``tokens``), arrivals that entered a worker's waiting queue, and the batch that
    started (None if none did)."""

    time: float
    tokens: tuple[tuple[int, int], ...]
    finished: tuple[Finished, ...]
    arrived: tuple[int, ...]
    step: StepInfo | None


@attrs.frozen(kw_only=True)
class TierStatistics:
    """The KV tiers of a worker (or their sums; ``core/engine/kv_tiers.py``): blocks held
    in each and their capacities, the prompt tokens fetched from each at admissions,
    fetches with their bytes and seconds, the tokens computed instead because computing
    them was cheaper, and the blocks written to each."""

    host_blocks: int = 0
    disk_blocks: int = 0
    host_capacity: int = 0
    disk_capacity: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    fetches: int = 0
    fetch_bytes: float = 0.0
    fetch_seconds: float = 0.0
    recomputed_tokens: int = 0
    host_stores: int = 0
    disk_stores: int = 0

    def __add__(self, other: TierStatistics) -> TierStatistics:
        return TierStatistics(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in attrs.fields(TierStatistics)
            }
        )


@attrs.frozen(kw_only=True)
class WorkerStatistics:
    """A snapshot of one worker (replica), from :meth:`Engine.statistics`.

    Attributes:
      waiting: requests in the worker's waiting queue (preempted ones included).
      running: requests (groups) admitted and not finished, preempted or aborted.
      running_seqs: their sequences, the number ``max_num_seqs`` caps.
      kv_used_blocks: KV blocks held by the running requests.
      kv_total_blocks: KV blocks of the replica.
      max_num_seqs: the current cap on running sequences.
      prefix_cache_queries: tokens looked up in the prefix cache at admissions.
      prefix_cache_hits: of them, tokens found cached (not computed).
      cached_blocks: blocks holding a known prefix, held or evictable (evictable ones
        count as free, not used).
      receiving: requests admitted with blocks for a remote prefill's KV, waiting for it.
      held: finished requests whose blocks are kept for a remote decode.
      busy_seconds: simulated seconds it spent stepping (its steps' durations, summed;
        a lockstep step counts on each of its ranks).
      tiers: its KV tiers behind HBM (None: none configured).
    """

    waiting: int
    running: int
    running_seqs: int
    kv_used_blocks: int
    kv_total_blocks: int
    max_num_seqs: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_blocks: int = 0
    receiving: int = 0
    held: int = 0
    busy_seconds: float = 0.0
    tiers: TierStatistics | None = None


@attrs.frozen(kw_only=True)
class QueueView:
    """One worker as its admission sees it, from :meth:`Engine.queue_views`.

    Attributes:
      running_seqs: running sequences.
      max_num_seqs: the cap on running sequences in force.
      free_blocks: free KV blocks.
      queued: per queued request, in the order the scheduler admits them: its sequences
        and the blocks its first prefill chunk takes when admitted.
    """

    running_seqs: int
    max_num_seqs: int
    free_blocks: int
    queued: tuple[tuple[int, int], ...]


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """A snapshot of the whole engine, from :meth:`Engine.statistics`.

    Attributes:
      now: the simulated time, in seconds.
      pending_arrivals: requests submitted whose arrival no ``step()`` has handled yet.
      waiting: requests in the workers' waiting queues (sum over workers).
      running: requests (groups) running on the workers.
      running_seqs: their sequences.
      kv_used_blocks: KV blocks held, over all workers.
      kv_total_blocks: KV blocks of all workers.
      kv_usage: ``kv_used_blocks / kv_total_blocks`` (0.0 without blocks).
      preemptions: preemptions since the engine was built.
      steps: batches run since the engine was built, over all workers.
      finished: requests that completed.
      aborted: requests removed by :meth:`Engine.abort`.
      max_num_seqs: the current per-worker cap on running sequences.
      workers: one :class:`WorkerStatistics` per worker, in worker order.
      prefix_caching: whether the deployment caches prefixes.
      prefix_cache_queries, prefix_cache_hits, cached_blocks: sums over workers.
      tiers: the workers' KV tiers, summed (None: none configured).
      transfers, transfer_bytes, transfer_seconds: KV transfers from a remote prefill
        started so far (disaggregation, or a decode server's), their bytes and seconds.
    """

    now: float
    pending_arrivals: int
    waiting: int
    running: int
    running_seqs: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_usage: float
    preemptions: int
    steps: int
    finished: int
    aborted: int
    max_num_seqs: int
    workers: tuple[WorkerStatistics, ...]
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_blocks: int = 0
    transfers: int = 0
    transfer_bytes: float = 0.0
    transfer_seconds: float = 0.0
    tiers: TierStatistics | None = None


# positional constructors of the records built every step / request (:mod:`builders`)
step_events = frozen_builder(StepEvents)
step_info = frozen_builder(StepInfo)
finished_record = frozen_builder(Finished)


def engine_statistics(
    *,
    now: float,
    pending_arrivals: int,
    preemptions: int,
    steps: int,
    finished: int,
    aborted: int,
    max_num_seqs: int,
    workers: tuple[WorkerStatistics, ...],
    prefix_caching: bool,
    transfers: tuple[int, float, float] = (0, 0.0, 0.0),
) -> EngineStatistics:
    """The engine's snapshot: its own counters and its workers' sums."""
    used = sum(ws.kv_used_blocks for ws in workers)
    total = sum(ws.kv_total_blocks for ws in workers)
    return EngineStatistics(
        now=now,
        pending_arrivals=pending_arrivals,
        waiting=sum(ws.waiting for ws in workers),
        running=sum(ws.running for ws in workers),
        running_seqs=sum(ws.running_seqs for ws in workers),
        kv_used_blocks=used,
        kv_total_blocks=total,
        kv_usage=used / total if total else 0.0,
        preemptions=preemptions,
        steps=steps,
        finished=finished,
        aborted=aborted,
        max_num_seqs=max_num_seqs,
        workers=workers,
        prefix_caching=prefix_caching,
        prefix_cache_queries=sum(ws.prefix_cache_queries for ws in workers),
        prefix_cache_hits=sum(ws.prefix_cache_hits for ws in workers),
        cached_blocks=sum(ws.cached_blocks for ws in workers),
        transfers=transfers[0],
        transfer_bytes=transfers[1],
        transfer_seconds=transfers[2],
        tiers=_tier_sum(workers),
    )


def _tier_sum(workers: tuple[WorkerStatistics, ...]) -> TierStatistics | None:
    tiers = [ws.tiers for ws in workers if ws.tiers is not None]
    if not tiers:
        return None
    total = tiers[0]
    for t in tiers[1:]:
        total = total + t
    return total


class StepLog(Protocol):
    """Where ``Engine.run_until`` writes the figures of the steps it starts (the
    simulator's ``StepTotals``): per step its KV usage and its FLOP and bandwidth
    utilisations, as a ``StepInfo`` would carry them, and the preemptions summed; a step
    with more to say (drafts, a lockstep step) is handed over whole to ``add``, which
    must keep those figures as the appends do."""

    kv_usage: array[float]
    flop_util: array[float]
    bw_util: array[float]
    preempted: int

    def add(self, info: StepInfo) -> None: ...
