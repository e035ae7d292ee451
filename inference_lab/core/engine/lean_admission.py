"""A decode run's lean admissions (:mod:`~inference_lab.core.engine.decode_runs` Rule 4):
the plain heads admitted into a step beside the decoding rows alone, and the step priced.

Rule 1: each plain head (one sequence, no prefix, no remote or resident KV) is admitted as
        ``DecodeRuns.enter_running`` admits it -- out of the waiting queue, its new blocks
        taken (``KVCacheManager.admit_plain``: nothing cached or cacheable, nothing
        evictable), running in admission order -- with those steps inline, until one does
        not fit (where ``Scheduler.admit_head`` stops too) or one is not plain (the
        general loop, ``_admit_into_whole``, admits from there).
Rule 2: the step is priced from the same terms as the whole step's: the roofline's common
        price (``Roofline.plain_price``) called directly, as ``price`` -- the roofline's
        -- would call it; an MLA model's terms are the roofline's own sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inference_lab.core.engine.outputs import StepLog
from inference_lab.core.engine.request import RUNNING, Request
from inference_lab.core.engine.running_rows import RunningRows
from inference_lab.core.roofline import BatchTerms, Roofline, StepCost

__all__ = ["admit_plain"]

Price = Callable[[BatchTerms], StepCost]


def admit_plain(
    worker: Any,
    vec: RunningRows,
    r: Request,
    n: int,
    blocks: int,
    left: int,
    now: float,
    price: Price,
    factor: float,
    log: StepLog,
) -> float:
    """The admissions of ``worker``'s (a ``DecodeRuns``, which imports this module) lean
    admission step from the plain head ``r`` (``n``
    positions, ``blocks`` new blocks, which the pool has; ``left`` tokens left in the
    step; the step's id counted), Rules 1 and 2, and the step started: its duration."""
    mark = worker.step_id
    waiting = worker.waiting
    pool = worker.pool
    kv = worker.kv
    p0, tail, bs = worker.room_flat
    running = worker.running
    order = worker.admit_order
    rest_c: list[int] = []
    rest_n = vec.rest_n
    while True:  # (FastPath._admit_into_whole's loop, for plain heads)
        waiting.pop()  # (enter_running, inline)
        first = r.first_scheduled_time < 0
        kv.admit_plain(r, blocks, first)
        if first:
            r.first_scheduled_time = now
        r.status = RUNNING
        r.admit_order = next(order)
        r.batch_mark = mark
        running.append(r)
        worker.running_seqs += 1
        rest_n.append(n)  # (RunningRows.append)
        vec.size += 1
        rest_c.append(r.num_computed)
        left -= n
        if left <= 0 or not waiting.count:
            break
        head = waiting.peek()
        assert head is not None  # (some waits)
        r = head
        n = worker._plain_chunk(r, left)
        if n < 0:  # not plain: the general admissions from here on
            out = worker._admit_into_whole(now, mark, left, vec, rest_c)
            duration: float = worker._priced_out(out, now, price, factor, log)
            return duration
        blocks = (-(-n // bs) + tail if n >= p0 else kv.blocks_for(n)) if n > 0 else 0
        if n == 0 or blocks > pool.free:
            break
    worker.step_budget = left
    worker.step_mark = mark
    roofline: Roofline = worker.roofline
    plain = roofline.plain_price
    if plain is None and roofline.has_mla():  # the roofline sums MLA classes
        terms = roofline.batch_terms(vec.ns(), vec.computed_now(running))
    elif len(rest_n) == 1:
        terms = vec.terms_with_one(rest_n[0], rest_c[0])
    else:
        terms = vec.terms_with(rest_n, rest_c)
    cost = price(terms) if plain is None else plain(terms.tokens, terms.seqs, terms.sums)
    duration = worker.set_priced(worker.fast_batch, terms, cost, now, factor, log)
    return duration
