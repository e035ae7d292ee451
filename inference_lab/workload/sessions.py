"""Multi-turn sessions (a workload's ``[sessions]`` table), and the session records
``sim --write-sessions`` writes.

Rule 1: the arrival pattern starts sessions (open loop: every start known up front, at
        the open loop's times; ``closed_loop``: each user starts its next session when its
        previous one ends); each turn is submitted a think time after the previous answer
        ended.
Rule 2: session starts come from the workload's generator; each session's plan (turns,
        user tokens, answers, think times, in that order) from a child generator spawned
        from it before any draw, in session order, so the first k sessions do not depend
        on how many there are.
Rule 3: no session starts at or after ``duration_secs``; ``num_requests`` caps the turns
        sent in all; a refused turn ends its session.
Rule 4: block hashes are made only when the caller gives a block size (the deployment
        caches prefixes), by the session plans of ``traffic.sessions``.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Workload
from inference_lab.errors import ConfigError
from inference_lab.traffic.sessions import SessionPlan, SessionRecord, Turn, shared_prefix
from inference_lab.workload.arrivals import CHUNK, Arrival, ArrivalGenerator, make_rng
from inference_lab.workload.open_loop import OpenLoopGenerator, chunk_times

__all__ = ["SessionGenerator", "session_records"]


class SessionGenerator(ArrivalGenerator):
    """Multi-turn sessions (Rule 5): the first turn of each session at its start, each
    later turn a think time after the previous answer ended (`follow_up`)."""

    reactive = True
    has_content = True
    has_sessions = True

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
            t, next_t = chunk_times(wl, gen.gaps(CHUNK), produced, next_t)
            keep = t[~(t >= self._duration) & np.isfinite(t)]
            left = self._max_sessions - produced
            kept = keep.tolist()[: int(left) if left < CHUNK else CHUNK]
            times += kept
            produced += len(kept)
            if len(kept) < CHUNK:
                break
        return times

    def planned_turns(self) -> int:
        """The turns of the sessions started and not ended (after :meth:`initial`, an open
        loop's every session): what they send at most."""
        return sum(len(plan.turns) for plan in self._plans.values())

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
