"""A stretch of pure decode steps: the inner loop of a decode run (fast path Rule 4).

Between two boundaries that change a worker's batch -- a request finishing, an arrival
(the run's limit), a KV block the pool cannot give -- every step is a pure decode step of
the same rows: each adds one position to every row, so each window class's attention
sum grows by a known integer per step. :func:`decode_stretch` starts those steps one
after another with nothing but the sums, the price and the calendar lookups between them.

Rule 1: the stretch starts the same steps, in the same order, with the same figures, as
        the decode run's loop one boundary at a time (``FastPath.decode_run``; compared to
        the bit by ``tests/test_engine_runs.py`` and ``tests/test_engine_stretch.py``): the
        sums move on by integers (a full-attention class by the row count, a sliding
        window class by its unsaturated rows before the saturations at the new count),
        which are exact, and each step's price, duration, end time and busy time come
        from the same floating-point operations in the same order.
Rule 2: a boundary inside a stretch ends a pure decode step (no row finishes there, but
        Rule 4) and changes nothing but the decode counter, the window saturations and
        the KV blocks the rows grow into; so the run's conditions checked at its first
        step (nothing waiting, the rows all decoding, the budget) hold throughout. The
        stretch stops after a step that ends at or past ``limit``, after one whose end
        finishes a row (but Rule 4), and at a boundary whose new blocks the pool cannot
        give (``short``).
Rule 3: a worker whose model has two window classes (full attention and one sliding
        window, as gpt-oss) and at most one stream after attention's takes the stretch
        specialised for them (:func:`_two_classes`): the two sums and the increment of
        the window's as locals, the pricer's arithmetic inline (decode_pricing Rule 3);
        the same operations in the same order as the general loop and its pricer.
Rule 4: that stretch also goes on across a boundary whose end finishes rows (given the
        decode run's ``ended``: not when the run stops after a finish): the worker ends
        the step as ``complete_fast`` would (``FastPath.finish_in_stretch``: the counter
        moves on, the finished rows are written back, freed and dropped in row order)
        and, when the rows left still hold the fast path, hands back the two-class
        constants of their count; the rows that grow into a block at that boundary take
        it (or the stretch stops there, short), and the next pass starts from the sums
        of the rows left -- the boundary the decode run would have handled, handled the
        same way.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from inference_lab.core.decode_pricing import DecodeStep, TwoClasses
from inference_lab.core.engine.block_pool import BlockPool
from inference_lab.core.engine.outputs import StepLog
from inference_lab.core.engine.running_rows import RunningRows

__all__ = ["DecodingWorker", "Ended", "Stretch", "decode_stretch"]

#: the requests a decode run ended: each with its finish time and its last step's duration
Ended = list[tuple[Any, float, float]]


class DecodingWorker(Protocol):
    """What a stretch uses of its worker (the scheduler's fast path half, ``FastPath``):
    its block pool and total, its busy time, and the growth of the decoding rows
    (``DecodeRuns.grow_at``)."""

    pool: BlockPool
    total_blocks: int
    busy_seconds: float

    def grow_at(self, vec: RunningRows, g: int, extra: int = 0) -> bool: ...

    def finish_in_stretch(
        self, vec: RunningRows, now: float, start: float, ended: Ended
    ) -> TwoClasses | None: ...


class Stretch(NamedTuple):
    """What :func:`decode_stretch` did: the steps it started, the boundaries it handled
    after the first step (each ended a step of the stretch), the start and end time of
    its last step, the time of its last boundary (``boundary``, the caller's when it
    handled none) and whether it stopped at a boundary whose blocks were short."""

    started: int
    boundaries: int
    start: float
    end: float
    boundary: float
    short: bool


def decode_stretch(
    worker: DecodingWorker,
    vec: RunningRows,
    step: DecodeStep,
    now: float,
    limit: float,
    factor: float,
    log: StepLog,
    ended: Ended | None = None,
) -> Stretch:
    """Start the pure decode step of ``vec``'s rows due at ``now`` (its blocks taken
    already) and those after it while each one's start is earlier than ``limit`` and
    the boundary before it is pure (Rule 2), their figures appended to ``log`` and
    their durations (``step``'s seconds x ``factor``) added to the worker's busy time.
    Called by ``FastPath.decode_run`` only; leaves ``vec.g`` at the count of the step in
    flight (or of the short boundary)."""
    windows = vec.windows
    if step.two is not None and windows[0] <= 0 < windows[1]:
        return _two_classes(worker, vec, step.two, now, limit, factor, log, ended)
    pricer = step.price
    finish_cal = vec.finish_cal
    grow_cal = vec.grow_cal
    windows = vec.windows
    rows = vec.decoding
    g = vec.g
    sums = vec.decode_step_sums()
    #: per class, what one more count adds to its sum (a window's: its unsaturated rows),
    #: and the window classes; made at the first pure boundary (most stretches of a
    #: heavily loaded worker are one step long)
    incs: list[int] = []
    windowed: list[tuple[int, dict[int, int], int]] = []
    classes = range(len(windows))
    pool = worker.pool
    total = worker.total_blocks
    usage = (total - pool.free) / total
    kv_log, flop_log, bw_log = log.kv_usage.append, log.flop_util.append, log.bw_util.append
    busy = worker.busy_seconds
    started = boundaries = 0
    boundary = start = now
    short = False
    while True:
        seconds, roof, compute, memory = pricer(sums)
        start = now
        duration = seconds * factor
        now = now + duration
        busy += duration
        if roof <= 0:
            roof = 1.0
        kv_log(usage)
        flop_log(compute / roof)
        bw_log(memory / roof)
        started += 1
        if now >= limit or g + 1 in finish_cal:
            break
        boundary = now  # a pure decode step's end: a token each, nothing finishes
        if not boundaries:
            incs = [rows if w <= 0 else vec.unsat[j] for j, w in enumerate(windows)]
            windowed = [(j, vec.sat_cal[j], w) for j, w in enumerate(windows) if w > 0]
        boundaries += 1
        g += 1
        for j in classes:
            sums[j] += incs[j]
        for j, cal, w in windowed:
            count = cal.pop(g, 0) if cal else 0
            if count:
                vec.sat[j] += count
                vec.unsat[j] -= count
                vec.unsat_sum[j] -= count * (w - 1 - g)
                incs[j] -= count
        if g in grow_cal:
            vec.g = g
            if not worker.grow_at(vec, g):
                short = True
                break
            usage = (total - pool.free) / total
    vec.g = g
    worker.busy_seconds = busy
    return Stretch(started, boundaries, start, now, boundary, short)


def _two_classes(
    worker: DecodingWorker,
    vec: RunningRows,
    k: TwoClasses,
    now: float,
    limit: float,
    factor: float,
    log: StepLog,
    ended: Ended | None,
) -> Stretch:
    """:func:`decode_stretch` for full attention and one sliding window (Rule 3): the
    same steps, figures and state, to the bit; with ``ended``, across finishes (Rule 4)."""
    finish_cal = vec.finish_cal
    grow_cal = vec.grow_cal
    sat_cal = vec.sat_cal[1]
    pool = worker.pool
    total = worker.total_blocks
    kv_log, flop_log, bw_log = log.kv_usage.append, log.flop_util.append, log.bw_util.append
    busy = worker.busy_seconds
    g = g0 = vec.g  # (the steps started and boundaries handled are counted from g at the end)
    start = now
    short = False
    while True:  # (a pass per count of rows: a finish inside the stretch starts the next)
        fa0, ma0, a0, k0, a1, k1, state, rate, bw, roof0, most, tail, seq, alpha, beta = k[:15]
        compute0, c_after, eta_f, memory0, m_after, eta_b = k[15:]
        rows = vec.decoding
        inc = vec.unsat[1]  # (what one more count adds to the window's sum)
        s0 = vec.base_sum + rows * g + rows  # (decode_step_sums, inline)
        s1 = vec.sat[1] * (vec.windows[1] - 1) + vec.unsat_sum[1] + inc * g + rows
        usage = (total - pool.free) / total
        while True:
            tc = (fa0 + a0 * s0 + a1 * s1) / rate  # (decode_pricing's price_two)
            tm = (ma0 + k0 * s0 + k1 * s1 + state) / bw
            roof = roof0 + (tc if tc > tm else tm) + most + tail + seq
            start = now
            duration = (alpha * roof + beta) * factor
            now = now + duration
            busy += duration
            if roof <= 0:
                roof = 1.0
            kv_log(usage)
            flop_log((compute0 + tc + c_after) * eta_f / roof)
            bw_log((memory0 + tm + m_after) * eta_b / roof)
            if now >= limit or g + 1 in finish_cal:
                break
            g += 1  # a pure decode step's end: a token each, nothing finishes
            s0 += rows
            s1 += inc
            if sat_cal and g in sat_cal:
                inc -= _saturate(vec, sat_cal.pop(g), g)
            if g in grow_cal:
                vec.g = g
                if not worker.grow_at(vec, g):
                    short = True
                    break
                usage = (total - pool.free) / total
        if short or now >= limit or ended is None:
            break
        vec.g = g  # (a finish due at the boundary ending the step in flight: Rule 4)
        two = worker.finish_in_stretch(vec, now, start, ended)
        if two is None:
            break
        k = two
        g = vec.g
        if g in grow_cal and not worker.grow_at(vec, g):
            short = True
            break
    vec.g = g
    worker.busy_seconds = busy
    if short:  # (its last boundary, at now, started no step)
        return Stretch(g - g0, g - g0, start, now, now, True)
    return Stretch(g - g0 + 1, g - g0, start, now, start, False)  # (the last boundary
    # handled is the last step's start, or the caller's now when it handled none)


def _saturate(vec: RunningRows, count: int, g: int) -> int:
    """``count`` rows of the window class saturate at ``g`` (their sums move over, as in
    :func:`decode_stretch`); returns ``count``."""
    vec.sat[1] += count
    vec.unsat[1] -= count
    vec.unsat_sum[1] -= count * (vec.windows[1] - 1 - g)
    return count
