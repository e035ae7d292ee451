"""Arrivals and the one interface every workload's generator offers the simulator.

Rule 1: one ``numpy.random.Generator`` per workload, seeded with ``Workload.seed`` (or the
        caller's override, :func:`make_rng`). Nothing else is random, so the same seed
        gives the same requests.
Rule 2: samples are drawn in fixed-size chunks of :data:`CHUNK`, in a fixed order, so the
        first k requests do not depend on ``num_requests`` or ``duration_secs``.
Rule 3: no clock and no engine: times are simulated seconds. A reactive generator (a
        closed loop, sessions) learns about completions from its caller
        (:meth:`ArrivalGenerator.follow_up`) and answers with what follows.

Lengths are sampled by the workload's distributions (``sample(rng, size)``: int64,
floored, >= 1); ``output_len`` is the number of tokens the request really produces (the
engine's ``target``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Workload
from inference_lab.errors import ConfigError

__all__ = [
    "CHUNK",
    "Arrival",
    "ArrivalArrays",
    "ArrivalGenerator",
    "Lengths",
    "check_bounded",
    "make_rng",
]

#: Samples are drawn this many at a time (Rule 2). Changing it changes every workload's
#: requests, so it is a constant, not an option.
CHUNK = 1024


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


class ArrivalArrays(NamedTuple):
    """An open loop's arrivals as arrays, in arrival order (the simulator feeds them to
    the engine lazily, without an :class:`Arrival` each)."""

    times: npt.NDArray[np.float64]
    prompt_tokens: npt.NDArray[np.int64]
    output_lens: npt.NDArray[np.int64]


class Lengths:
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


def check_bounded(workload: Workload) -> None:
    if workload.num_requests is None and workload.duration_secs is None:
        raise ConfigError("workload: needs num_requests or duration_secs (else it never ends)")


class ArrivalGenerator:
    """The simulator's view of a workload: the arrival source every generator is (made by
    :func:`inference_lab.workload.make_generator`, driven by
    :func:`inference_lab.sim.run.run_simulation`).

    The caller takes :meth:`arrays` when it returns arrays (an open loop: every arrival
    known up front, fed lazily), else submits everything :meth:`initial` returns; then,
    when :attr:`reactive`, it calls :meth:`follow_up` for each finished (or refused)
    request: a closed loop answers with that user's next request, a session with its next
    turn.
    """

    closed_loop: bool = False
    #: whether completions feed back (`follow_up`): a closed loop or sessions
    reactive: bool = False
    #: whether the requests say anything about their content (prefix caching can hit)
    has_content: bool = False
    #: whether the arrivals are turns of sessions (the run reports them by turn)
    has_sessions: bool = False
    #: the requests the workload will issue, when known up front (for progress)
    total: int | None = None
    #: the seed the arrivals are drawn with (`make_generator` sets it; a trace's is 0)
    seed: int = 0

    def arrays(self) -> ArrivalArrays | None:
        """Every arrival as arrays, when the generator knows them all up front and none
        depends on a completion (an open loop); None: submit :meth:`initial`."""
        return None

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
