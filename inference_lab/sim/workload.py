"""Arrival generation for the offline simulator: a pure function of a `Workload` and a seed.

Rule 1: one `numpy.random.Generator` per workload, seeded with `Workload.seed` (or the
        caller's override). Nothing else is random, so the same seed gives the same requests.
Rule 2: samples are drawn in fixed-size chunks, in a fixed order (open loop: gaps, prompt
        lengths, output lengths; closed loop: the users' start jitter once, then lengths), so
        the first k requests do not depend on `num_requests` or `duration_secs`.
Rule 3: no clock and no engine: times are simulated seconds. A closed loop learns about
        completions from its caller (`on_complete`) and answers with that user's next request.
Rule 4: the first open-loop arrival is at t = 0 and arrival k is at the sum of the first k
        gaps (uniform: exactly k / rate). Generation stops at `num_requests` or before the
        first arrival at or after `duration_secs`, whichever comes first. With a
        `[rate_schedule]`, the gaps are drawn at rate 1 (uniform: the integers) and mapped
        through the schedule's cumulative rate (`traffic.schedules.arrival_times`).
Rule 5: sessions (`[sessions]`): the arrival pattern starts sessions (open loop: every
        start known up front; `closed_loop`: each user starts its next session when its
        previous one ends); each turn is submitted a think time after the previous
        answer ended. Session starts come from the workload's generator; each session's
        plan (turns, user tokens, answers, think times, in that order) from a child
        generator spawned from it before any draw, in session order, so the first k
        sessions do not depend on how many there are. No session starts at or after
        `duration_secs`; `num_requests` caps the turns sent in all; a refused turn ends
        its session.
Rule 6: block hashes are made only when the caller gives a block size (the deployment
        caches prefixes): a session's turns by `traffic.sessions`, a trace's requests from
        its `hash_ids` (Mooncake) or its prompt tokens (OpenAI batch).

Lengths are sampled by the workload's distributions (`sample(rng, size)`: int64, floored,
>= 1); `output_len` is the number of tokens the request really produces (the engine's
`target`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Workload
from inference_lab.errors import ConfigError
from inference_lab.traffic.hashing import token_block_hashes, trace_block_hashes
from inference_lab.traffic.schedules import arrival_times
from inference_lab.traffic.sessions import SessionPlan, SessionRecord, Turn, shared_prefix
from inference_lab.traffic.traces import MOONCAKE_BLOCK, Trace

__all__ = [
    "CHUNK",
    "Arrival",
    "ArrivalGenerator",
    "ClosedLoopGenerator",
    "OpenLoopGenerator",
    "SessionGenerator",
    "TraceGenerator",
    "make_generator",
    "make_rng",
    "session_records",
]

#: Samples are drawn this many at a time (Rule 2). Changing it changes every workload's
#: requests, so it is a constant, not an option.
CHUNK = 1024

_BURST_PROBABILITY = 0.2
_BURST_SHORT_GAP = (0.001, 0.010)  # seconds: a request inside a burst
_BURST_LONG_GAP = (0.5, 2.0)  # seconds: the pause between bursts


@attrs.frozen
class Arrival:
    """One request to submit: when, how long its prompt is, how many tokens it produces;
    its hash chain (empty: none), its session and turn (-1 outside sessions) and its
    number of sequences."""

    time: float
    prompt_tokens: int
    output_len: int
    user: int = -1  # closed loop: the user that sends it; -1 for open-loop patterns
    block_hashes: tuple[int, ...] = ()
    session: int = -1
    turn: int = -1
    n: int = 1


def make_rng(workload: Workload, seed: int | None = None) -> np.random.Generator:
    """The workload's one generator (Rule 1): `seed` when given (`--seed`), else
    `workload.seed`. Called by `make_generator` here and by serve for response lengths."""
    return np.random.default_rng(workload.seed if seed is None else seed)


class _Lengths:
    """An endless stream of (prompt_tokens, output_len) pairs drawn CHUNK at a time."""

    def __init__(self, workload: Workload, rng: np.random.Generator) -> None:
        self._workload = workload
        self._rng = rng
        self._iter = self._pairs()

    def _pairs(self) -> Iterator[tuple[int, int]]:
        while True:
            prompts, outputs = self.draw()
            yield from zip(prompts.tolist(), outputs.tolist(), strict=True)

    def draw(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """One chunk of prompt lengths then one chunk of output lengths (both >= 1)."""
        prompts = np.maximum(self._workload.input_len_dist.sample(self._rng, CHUNK), 1)
        outputs = np.maximum(self._workload.output_len_dist.sample(self._rng, CHUNK), 1)
        return prompts.astype(np.int64), outputs.astype(np.int64)

    def next(self) -> tuple[int, int]:
        return next(self._iter)


def _chunk_times(
    wl: Workload, gaps: npt.NDArray[np.float64], produced: int, next_t: float
) -> tuple[npt.NDArray[np.float64], float]:
    """The times of the open-loop chunk whose first arrival is number ``produced`` and
    whose unit-clock time is ``next_t`` (Rule 4), and the next chunk's ``next_t``."""
    schedule = wl.rate_schedule
    if wl.arrival_pattern == "uniform":
        unit = np.arange(produced, produced + CHUNK, dtype=np.float64)
        if schedule is None:
            return unit / wl.arrival_rate, next_t
        return arrival_times(schedule, unit), next_t
    t = next_t + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    next_t = float(t[-1] + gaps[-1])
    if schedule is not None:
        t = arrival_times(schedule, t)
    return t, next_t


def _check_bounded(workload: Workload) -> None:
    if workload.num_requests is None and workload.duration_secs is None:
        raise ConfigError("workload: needs num_requests or duration_secs (else it never ends)")


class ArrivalGenerator:
    """The sim loop's view of a workload (made by `make_generator`, driven by
    `sim.run_simulation`).

    The caller submits everything `initial()` returns, then calls `follow_up(arrival, t,
    refused)` for each finished (or refused) request when `reactive`; a closed loop
    answers with that user's next request, a session with its next turn.
    """

    closed_loop: bool = False
    #: whether completions feed back (`follow_up`): a closed loop or sessions
    reactive: bool = False
    #: whether the requests say anything about their content (prefix caching can hit)
    has_content: bool = False

    def initial(self) -> list[Arrival]:
        """The arrivals known before the first step, in arrival order: every one of an open
        loop, each user's first of a closed loop."""
        raise NotImplementedError

    def on_complete(self, user: int, time: float) -> Arrival | None:
        """The next request of `user`, whose previous request ended at `time`, or None."""
        return None

    def follow_up(self, arrival: Arrival, time: float, refused: bool) -> Arrival | None:
        """What follows `arrival`, which finished (or was refused) at `time`, or None."""
        return self.on_complete(arrival.user, time)


class OpenLoopGenerator(ArrivalGenerator):
    """poisson / uniform / burst / batched: every arrival is known up front."""

    def __init__(self, workload: Workload, rng: np.random.Generator, check: bool = True) -> None:
        if check:
            _check_bounded(workload)
        pattern = workload.arrival_pattern
        if pattern not in ("poisson", "uniform", "burst", "batched"):
            raise ConfigError(f"workload: arrival_pattern {pattern!r} is not an open-loop pattern")
        if pattern in ("poisson", "uniform") and not workload.arrival_rate > 0:
            raise ConfigError(f"workload: arrival_rate must be > 0, got {workload.arrival_rate}")
        self._workload = workload
        self._rng = rng

    def _gaps(self, n: int) -> npt.NDArray[np.float64]:
        rng = self._rng
        pattern = self._workload.arrival_pattern
        rate = self._workload.arrival_rate
        if self._workload.rate_schedule is not None:
            rate = 1.0  # drawn on the unit clock, then mapped (Rule 4)
        if pattern == "poisson":
            return rng.exponential(1.0 / rate, n)
        if pattern == "burst":
            in_burst = rng.random(n) < _BURST_PROBABILITY
            short = rng.uniform(*_BURST_SHORT_GAP, n)
            long = rng.uniform(*_BURST_LONG_GAP, n)
            return np.where(in_burst, short, long)
        # uniform and batched need no randomness (uniform times are computed exactly below)
        return np.zeros(n)

    def arrays(
        self,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """All arrivals as (times, prompt_tokens, output_lens), in arrival order."""
        wl = self._workload
        limit = wl.num_requests if wl.num_requests is not None else math.inf
        duration = wl.duration_secs if wl.duration_secs is not None else math.inf
        lengths = _Lengths(wl, self._rng)
        times: list[npt.NDArray[np.float64]] = []
        prompts: list[npt.NDArray[np.int64]] = []
        outputs: list[npt.NDArray[np.int64]] = []
        produced = 0
        next_t = 0.0
        while produced < limit:
            gaps = self._gaps(CHUNK)
            chunk_prompts, chunk_outputs = lengths.draw()
            t, next_t = _chunk_times(wl, gaps, produced, next_t)
            keep = CHUNK if limit - produced >= CHUNK else int(limit - produced)
            past = np.flatnonzero(t[:keep] >= duration)
            if wl.rate_schedule is not None:  # a schedule whose rate ends: no time at all
                past = np.flatnonzero((t[:keep] >= duration) | np.isinf(t[:keep]))
            if past.size:
                keep = int(past[0])
            times.append(t[:keep])
            prompts.append(chunk_prompts[:keep])
            outputs.append(chunk_outputs[:keep])
            produced += keep
            if keep < CHUNK:
                break
        return (
            np.concatenate(times) if times else np.zeros(0),
            np.concatenate(prompts) if prompts else np.zeros(0, np.int64),
            np.concatenate(outputs) if outputs else np.zeros(0, np.int64),
        )

    def initial(self) -> list[Arrival]:
        times, prompts, outputs = self.arrays()
        return [
            Arrival(t, p, o)
            for t, p, o in zip(times.tolist(), prompts.tolist(), outputs.tolist(), strict=True)
        ]


class ClosedLoopGenerator(ArrivalGenerator):
    """N users; each sends its next request the moment its previous one ends.

    First arrivals are U(0, closed_loop_jitter_secs) (all at 0 without jitter). A user stops
    once `num_requests` requests have been issued in all, or when its previous request ends at
    or after `duration_secs`.
    """

    closed_loop = True
    reactive = True

    def __init__(self, workload: Workload, rng: np.random.Generator) -> None:
        _check_bounded(workload)
        users = workload.num_concurrent_users
        if users is None or users < 1:
            raise ConfigError("workload: closed_loop needs num_concurrent_users >= 1")
        self._workload = workload
        self._rng = rng
        self._users = users
        self._issued = 0
        self._limit = workload.num_requests if workload.num_requests is not None else math.inf
        self._duration = workload.duration_secs if workload.duration_secs is not None else math.inf
        jitter = workload.closed_loop_jitter_secs
        self._starts: list[float] = (
            rng.uniform(0.0, jitter, users).tolist() if jitter > 0 else [0.0] * users
        )
        self._lengths = _Lengths(workload, rng)

    def _issue(self, user: int, time: float) -> Arrival | None:
        if self._issued >= self._limit or time >= self._duration:
            return None
        self._issued += 1
        prompt, output = self._lengths.next()
        return Arrival(time, prompt, output, user)

    def initial(self) -> list[Arrival]:
        out = []
        for user, start in enumerate(self._starts):
            arrival = self._issue(user, start)
            if arrival is not None:
                out.append(arrival)
        return out

    def on_complete(self, user: int, time: float) -> Arrival | None:
        return self._issue(user, time)


class SessionGenerator(ArrivalGenerator):
    """Multi-turn sessions (Rule 5): the first turn of each session at its start, each
    later turn a think time after the previous answer ended (`follow_up`)."""

    reactive = True
    has_content = True

    def __init__(
        self, workload: Workload, rng: np.random.Generator, block_size: int | None
    ) -> None:
        sessions = workload.sessions
        if sessions is None:
            raise ConfigError("workload: a session generator needs a [sessions] table")
        self._workload = workload
        self._config = sessions
        self._rng = rng
        self._plan_rng = rng.spawn(1)[0]  # before any draw (Rule 5)
        self._block_size = block_size
        self._shared = (
            shared_prefix(sessions.system_prompt_tokens, block_size)
            if sessions.shared_system_prompt and block_size is not None
            else None
        )
        inf = math.inf
        self._max_sessions = sessions.num_sessions if sessions.num_sessions is not None else inf
        self._max_requests = workload.num_requests if workload.num_requests is not None else inf
        self._duration = workload.duration_secs if workload.duration_secs is not None else inf
        self._sessions = 0  # sessions started
        self._issued = 0  # turns sent
        self._plans: dict[int, SessionPlan] = {}
        self.closed_loop = workload.arrival_pattern == "closed_loop"

    def _plan(self) -> SessionPlan:
        """The next session's plan, drawn from the plan generator in session order."""
        cfg = self._config
        rng = self._plan_rng
        turns = int(cfg.turns.sample(rng, 1)[0])
        users = _lengths(self._workload.input_len_dist.sample(rng, turns))
        outputs = _lengths(self._workload.output_len_dist.sample(rng, turns))
        thinks = cfg.think_time.sample(rng, turns).tolist()
        plan = SessionPlan(
            self._sessions,
            [
                Turn(u, o, 0.0 if k == 0 else max(float(thinks[k]), 0.0))
                for k, (u, o) in enumerate(zip(users, outputs, strict=True))
            ],
            cfg.system_prompt_tokens,
            self._block_size,
            self._shared,
        )
        self._sessions += 1
        return plan

    def _turn(self, plan: SessionPlan, k: int, time: float, user: int) -> Arrival | None:
        if self._issued >= self._max_requests:
            return None
        self._issued += 1
        return Arrival(
            time,
            plan.prompt_tokens(k),
            plan.turns[k].output_tokens,
            user,
            plan.hashes(k),
            plan.session,
            k,
        )

    def _start(self, time: float, user: int) -> Arrival | None:
        """A new session's first turn at ``time``, if sessions and turns remain."""
        if self._sessions >= self._max_sessions or time >= self._duration:
            return None
        if self._issued >= self._max_requests:
            return None
        plan = self._plan()
        self._plans[plan.session] = plan
        return self._turn(plan, 0, time, user)

    def initial(self) -> list[Arrival]:
        wl = self._workload
        out = []
        if self.closed_loop:
            users = wl.num_concurrent_users or 1
            jitter = wl.closed_loop_jitter_secs
            starts = self._rng.uniform(0.0, jitter, users).tolist() if jitter > 0 else [0.0] * users
        else:
            starts = self._start_times()
            users = len(starts)
        for user in range(users):
            arrival = self._start(starts[user], user if self.closed_loop else -1)
            if arrival is None:
                break
            out.append(arrival)
        return out

    def _start_times(self) -> list[float]:
        """Open loop: every session's start, by the arrival pattern (Rule 4's times)."""
        wl = self._workload
        gen = OpenLoopGenerator(wl, self._rng, check=False)
        times: list[float] = []
        produced = 0
        next_t = 0.0
        while produced < self._max_sessions:
            t, next_t = _chunk_times(wl, gen._gaps(CHUNK), produced, next_t)
            keep = t[~(t >= self._duration) & np.isfinite(t)]
            left = self._max_sessions - produced
            kept = keep.tolist()[: int(left) if left < CHUNK else CHUNK]
            times += kept
            produced += len(kept)
            if len(kept) < CHUNK:
                break
        return times

    def follow_up(self, arrival: Arrival, time: float, refused: bool) -> Arrival | None:
        plan = self._plans.get(arrival.session)
        if plan is None:
            return None
        k = arrival.turn + 1
        if not refused and k < len(plan.turns):
            return self._turn(plan, k, time + plan.turns[k].think_time, arrival.user)
        del self._plans[arrival.session]  # the session ends
        if self.closed_loop:
            return self._start(time, arrival.user)
        return None


def session_records(workload: Workload, seed: int | None = None) -> list[SessionRecord]:
    """The sessions a run of ``workload`` (with ``seed``) draws, as session-file records
    (``traffic.sessions``, Rule 3): the same plans, in session order, and for an open loop
    the same start times; a closed loop's sessions have no start (each user takes the
    next one when its previous one ends). Sessions are drawn until ``num_sessions``, or
    until their turns reach ``num_requests``; an open loop stops at ``duration_secs``.
    For ``sim --write-sessions`` (``inference-lab load --sessions`` replays the file)."""
    gen = SessionGenerator(workload, make_rng(workload, seed), None)
    cfg = gen._config
    if gen.closed_loop:
        if cfg.num_sessions is None and workload.num_requests is None:
            raise ConfigError(
                "workload: writing a closed loop's sessions needs num_sessions or num_requests"
            )
        limit = gen._max_sessions
        wl = workload
        users = wl.num_concurrent_users or 1
        if wl.closed_loop_jitter_secs > 0:
            gen._rng.uniform(0.0, wl.closed_loop_jitter_secs, users)  # as initial() draws
        starts: list[float | None] = []
    else:
        starts = list(gen._start_times())
        limit = len(starts)
    out: list[SessionRecord] = []
    turns = 0
    while len(out) < limit and turns < gen._max_requests:
        plan = gen._plan()
        out.append(
            SessionRecord(
                session=plan.session,
                start=starts[len(out)] if starts else None,
                system_prompt_tokens=cfg.system_prompt_tokens,
                shared_system_prompt=cfg.shared_system_prompt,
                turns=plan.turns,
            )
        )
        turns += len(plan.turns)
    return out


def _lengths(values: npt.NDArray[np.int64]) -> list[int]:
    """Sampled lengths as Python ints >= 1."""
    return [int(v) for v in np.maximum(values, 1)]


class TraceGenerator(ArrivalGenerator):
    """A trace's requests, each at its time (Rule 6 for their hashes)."""

    def __init__(self, trace: Trace, block_size: int | None) -> None:
        self._trace = trace
        self._block_size = block_size
        self.has_content = trace.has_content

    def initial(self) -> list[Arrival]:
        bs = self._block_size
        out = []
        for r in self._trace.requests:
            hashes: tuple[int, ...] = ()
            if bs is not None:
                if r.hash_ids:
                    hashes = trace_block_hashes(r.hash_ids, r.input_tokens, bs, MOONCAKE_BLOCK)
                elif r.tokens:
                    hashes = token_block_hashes(r.tokens, bs)
            out.append(Arrival(r.time, r.input_tokens, r.output_tokens, -1, hashes, n=r.n))
        return out


def make_generator(
    workload: Workload | Trace, seed: int | None = None, block_size: int | None = None
) -> ArrivalGenerator:
    """The generator for `workload`'s arrival pattern (or a trace's requests), seeded per
    `make_rng`; `block_size` (a deployment that caches prefixes) makes block hashes
    (Rule 6).

    Raises ConfigError for a workload that is unbounded or lacks what its pattern needs.
    """
    if isinstance(workload, Trace):
        return TraceGenerator(workload, block_size)
    rng = make_rng(workload, seed)
    if workload.sessions is not None:
        return SessionGenerator(workload, rng, block_size)
    if workload.arrival_pattern == "closed_loop":
        return ClosedLoopGenerator(workload, rng)
    return OpenLoopGenerator(workload, rng)
