"""How a simulation's arrivals enter the engine: submitted one at a time (with a reactive
workload's follow-ups), or fed from an open loop's arrays as the loop reaches them.

Rule 1: every request is submitted with ``max_tokens = target =`` the sampled output
        length, so it runs to its sampled length and finishes with reason ``length``; a
        request the deployment can never run (``RequestRefused``) is counted apart as a
        :class:`~inference_lab.sim.records.Refused` and, in a reactive workload, what
        follows it is submitted at once (a closed-loop user moves on; a session's refused
        turn ends the session).
Rule 2: an open loop's arrivals are fed in chunks of :data:`FEED_CHUNK`, in arrival
        order, each chunk before the engine handles an event later than its first
        arrival, filed in the engine's heap as if submitted up front (``preorder``, the
        engine's Rule 6): the run is the one in which every arrival was submitted before
        the first step. An arrival without a worker hint or an adapter is handed over as
        its two lengths and its time (``Engine.submit_plain``, the engine's Rule 8: the
        same request, without a ``RequestSpec`` each).
Rule 3: :data:`MAX_REFUSAL_STREAK` refusals in a row without one admitted request is a
        :class:`~inference_lab.errors.SimError` (a closed loop refused at one instant
        would spin forever).
Rule 4: an arrival refused by ``max_waiting`` is handed back (:meth:`Intake.park`); a
        reactive workload's refused users try again at the next completion, after that
        completion's own follow-ups, never at the same instant.

Who uses it: :func:`inference_lab.sim.run.run_simulation` builds one :class:`Intake` and,
for an open loop, one :class:`OpenLoopFeed`; the ``max_waiting`` observer refuses and
parks through the intake.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from inference_lab.core.builders import frozen_builder
from inference_lab.core.engine import Engine, Finished, RequestSpec
from inference_lab.errors import RequestRefused, SimError
from inference_lab.sim.records import ArrivalTable, Refused
from inference_lab.workload.adapters import AdapterPicker
from inference_lab.workload.arrivals import Arrival, ArrivalArrays, ArrivalGenerator

__all__ = ["FEED_CHUNK", "MAX_REFUSAL_STREAK", "Intake", "OpenLoopFeed", "open_loop_feed"]

#: A closed loop whose users are refused this many times in a row without one admitted
#: request would spin forever at one simulated instant; it is reported as an error instead.
MAX_REFUSAL_STREAK = 100_000
#: An open loop's arrivals are handed to the engine this many at a time (Rule 2).
FEED_CHUNK = 256


class Intake:
    """Submits a workload's arrivals to the engine and keeps what became of them: the
    refusals, the arrival of each request id (``arrivals``: a dict, or an open loop's
    :class:`ArrivalTable`) and the earliest arrival time (module rules)."""

    __slots__ = (
        "_engine", "_generator", "_reactive", "refused", "held", "arrivals",
        "first_arrival", "streak", "_parked", "adapters", "_route",
    )  # fmt: skip

    def __init__(
        self,
        engine: Engine,
        generator: ArrivalGenerator,
        adapters: AdapterPicker | None = None,
        route: Callable[[Arrival], int] | None = None,
    ) -> None:
        self._engine = engine
        #: each arrival's worker, routed by the caller (a session shard:
        #: ``sim.shard_sessions``); None: the engine's router places it
        self._route = route
        #: the LoRA adapter of each request (None: every request is the base model's)
        self.adapters = adapters
        self._generator = generator
        self._reactive = generator.reactive
        self.refused: list[Refused] = []
        #: request id -> its arrival (an open loop's are in its feed's table instead)
        self.held: dict[int, Arrival] = {}
        self.arrivals: dict[int, Arrival] | ArrivalTable = self.held
        self.first_arrival = math.inf
        #: refusals since the last admitted request (Rule 3)
        self.streak = 0
        self._parked: list[Arrival] = []

    def refuse(self, arrival: Arrival, limit: str, reason: str) -> None:
        """Count ``arrival`` as refused (``limit``: why); raises SimError past the
        streak bound (Rule 3)."""
        self.refused.append(Refused(arrival, limit, reason))
        self.streak += 1
        if self.streak >= MAX_REFUSAL_STREAK:
            raise SimError(
                f"{self.streak} requests in a row refused ({reason}); "
                "the workload cannot run on this deployment"
            )

    def submit(self, arrival: Arrival | None) -> None:
        """Submit ``arrival`` (None: nothing); a refused one's follow-up is submitted in
        its place, until one is admitted or none follows (Rule 1)."""
        generator = self._generator
        while arrival is not None:
            if arrival.time < self.first_arrival:
                self.first_arrival = arrival.time
            spec = RequestSpec(
                prompt_tokens=arrival.prompt_tokens,
                max_tokens=arrival.output_len,
                arrival_time=arrival.time,
                n=arrival.n,
                block_hashes=arrival.block_hashes,
                lora=None if self.adapters is None else self.adapters.pick(arrival),
                session=_session_key(arrival),
                worker=None if self._route is None else self._route(arrival),
            )
            try:
                request_id = self._engine.submit(spec)
            except RequestRefused as exc:
                self.refuse(arrival, exc.limit, exc.reason)
                arrival = (
                    generator.follow_up(arrival, arrival.time, True) if self._reactive else None
                )
                continue
            self.streak = 0
            self.held[request_id] = arrival
            return

    def park(self, arrival: Arrival) -> None:
        """``arrival`` was refused by ``max_waiting``: a reactive workload's user tries
        again at the next completion (Rule 4)."""
        if self._reactive:
            self._parked.append(arrival)

    def on_finished(self, finished: Sequence[Finished], time: float) -> None:
        """A reactive workload's follow-ups of the requests ``finished`` at ``time`` (one
        event's completions), then the parked users' (Rule 4). Called by the loop for each
        event with completions."""
        generator = self._generator
        arrivals = self.arrivals
        for f in finished:
            self.submit(generator.follow_up(arrivals[f.request_id], f.finish_time, False))
        if self._parked:
            again, self._parked = self._parked, []
            for arrival in again:
                self.submit(generator.follow_up(arrival, time, True))


def _session_key(arrival: Arrival) -> int | None:
    """What the ``session_affinity`` router keys ``arrival`` by: its session, else its
    closed-loop user, else nothing."""
    if arrival.session >= 0:
        return arrival.session
    return arrival.user if arrival.user >= 0 else None


class OpenLoopFeed:
    """An open loop's arrivals, fed to the engine from arrays (Rule 2): the loop calls
    :meth:`feed` before the engine handles an event past :attr:`next_time`."""

    def __init__(
        self,
        engine: Engine,
        intake: Intake,
        arrays: ArrivalArrays,
        workers: npt.NDArray[np.int32] | None = None,
    ) -> None:
        self._engine = engine
        #: each arrival's worker, routed by the caller (a shard: ``sim.shard``); None:
        #: the engine's router places them
        self._workers = workers
        self._intake = intake
        times, prompts, outputs = arrays
        self.times = times
        self._prompts = prompts
        self._outputs = outputs
        self.table = ArrivalTable(times, prompts, outputs)
        intake.arrivals = self.table
        self._count = len(times)
        if self._count:
            intake.first_arrival = float(times.min())
        self._fed = 0
        #: the time of the next arrival not yet fed (inf: all fed)
        self.next_time = float(times[0]) if self._count else math.inf
        #: positions of the fed arrivals the deployment can never run
        self.never_fit: list[int] = []
        self._new_spec = frozen_builder(RequestSpec)  # (RequestSpec's __init__, at half the cost)

    def feed(self) -> float:
        """Hand the next FEED_CHUNK arrivals to the engine; returns the new
        :attr:`next_time`."""
        intake = self._intake
        table = self.table
        submit = self._engine.submit
        plain = self._engine.submit_plain
        new_spec = self._new_spec
        fed = self._fed
        end = min(fed + FEED_CHUNK, self._count)
        adapters = intake.adapters
        # an adapter per arrival, in arrival order, from its own stream (adapters Rule 2)
        loras = None if adapters is None else adapters.draws(end - fed)
        hints = None if self._workers is None else self._workers[fed:end].tolist()
        for i, t, p, o in zip(
            range(fed, end),
            self.times[fed:end].tolist(),
            self._prompts[fed:end].tolist(),
            self._outputs[fed:end].tolist(),
            strict=True,
        ):
            try:
                if hints is not None:  # (a shard: no adapters)
                    spec = new_spec(
                        prompt_tokens=p, max_tokens=o, arrival_time=t, worker=hints[i - fed]
                    )
                    request_id = submit(spec, preorder=i)
                elif loras is None:  # (no spec object: engine Rule 8)
                    request_id = plain(p, o, t, i)
                else:
                    spec = new_spec(
                        prompt_tokens=p, max_tokens=o, arrival_time=t, lora=loras[i - fed]
                    )
                    request_id = submit(spec, preorder=i)
            except RequestRefused as exc:
                self.never_fit.append(i)
                intake.refuse(table.arrival(i), exc.limit, exc.reason)
                continue
            intake.streak = 0
            table.add(request_id, i)
        self._fed = end
        self.next_time = float(self.times[end]) if end < self._count else math.inf
        return self.next_time


def open_loop_feed(
    engine: Engine, intake: Intake, generator: ArrivalGenerator
) -> OpenLoopFeed | None:
    """The feed of an open loop's arrays (Rule 2), or None for a workload whose arrivals
    are submitted one by one (a closed loop, sessions, a trace): the generator says
    which (:meth:`ArrivalGenerator.arrays`)."""
    arrays = generator.arrays()
    return None if arrays is None else OpenLoopFeed(engine, intake, arrays)
