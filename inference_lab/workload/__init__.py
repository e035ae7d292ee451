"""A workload's arrivals for the simulator: one generator per kind of workload, behind
one interface (:class:`~inference_lab.workload.arrivals.ArrivalGenerator`).

- :mod:`~inference_lab.workload.arrivals`: ``Arrival``, the interface, the seeded lengths;
- :mod:`~inference_lab.workload.open_loop`: poisson, uniform, burst, batched;
- :mod:`~inference_lab.workload.closed_loop`: N users back to back;
- :mod:`~inference_lab.workload.sessions`: multi-turn sessions, and their records;
- :mod:`~inference_lab.workload.traces`: a trace's requests.

A pure function of a ``Workload`` (or a ``Trace``) and a seed: no clock, no engine. Below
the simulator (``sim/``), above the config (``core/config``) and the pure traffic shapes
(``traffic/``: session plans and files, trace readers, hashes, rate schedules), which the
load client shares; the load client never reaches this package.
"""

from __future__ import annotations

from inference_lab.core.config import Workload
from inference_lab.traffic.traces import Trace
from inference_lab.workload.arrivals import (
    CHUNK,
    Arrival,
    ArrivalArrays,
    ArrivalGenerator,
    make_rng,
)
from inference_lab.workload.closed_loop import ClosedLoopGenerator
from inference_lab.workload.open_loop import OpenLoopGenerator
from inference_lab.workload.sessions import SessionGenerator, session_records
from inference_lab.workload.traces import TraceGenerator

__all__ = [
    "CHUNK",
    "Arrival",
    "ArrivalArrays",
    "ArrivalGenerator",
    "ClosedLoopGenerator",
    "OpenLoopGenerator",
    "SessionGenerator",
    "TraceGenerator",
    "make_generator",
    "make_rng",
    "session_records",
]


def make_generator(
    workload: Workload | Trace, seed: int | None = None, block_size: int | None = None
) -> ArrivalGenerator:
    """The generator for `workload`'s arrival pattern (or a trace's requests), seeded per
    `make_rng`; `block_size` (a deployment that caches prefixes) makes block hashes
    (sessions' Rule 4, traces' Rule 1). Sets the generator's `seed`.

    Raises ConfigError for a workload that is unbounded or lacks what its pattern needs.
    """
    if isinstance(workload, Trace):
        return TraceGenerator(workload, block_size)
    rng = make_rng(workload, seed)
    generator: ArrivalGenerator
    if workload.sessions is not None:
        generator = SessionGenerator(workload, rng, block_size)
    elif workload.arrival_pattern == "closed_loop":
        generator = ClosedLoopGenerator(workload, rng)
    else:
        generator = OpenLoopGenerator(workload, rng)
    generator.seed = workload.seed if seed is None else seed
    return generator
