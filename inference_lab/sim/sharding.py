"""What may be sharded (``inference-lab sim --ray``), and how a sharded run says what it
did: the rules of :mod:`inference_lab.sim.fleet` that the rest of the simulator reads.

Rule 1: a deployment is sharded only when its replicas can be simulated apart: its
        router must send each arrival to a replica whatever the replicas' state
        (:data:`STATE_BLIND`: ``round_robin``, the ``k``-th arrival to worker ``k mod W``;
        ``random``, to ``draw(router_seed, k) mod W``; ``session_affinity``, a session's
        turns to ``draw(router_seed, session) mod W``, a request without a session as
        ``random``: :func:`route`), the workload's arrivals must not depend on
        completions on other replicas (an open loop: poisson, uniform, burst, batched;
        a trace; under ``session_affinity``, sessions started by an open loop: a turn
        follows its own session's answer, on its own replica), ``max_waiting`` must be 0 (it bounds the waiting places of all
        replicas together, as serve's admission counts them, and a shard sees only its
        own) and it must not speculate (its acceptance draws come from one generator
        shared by every replica, in the deployment's event order).
        :func:`check_shardable` says which does not hold, in one line.
Rule 2: :class:`FleetInfo` rides on a sharded run's ``SimResult``: the shards, the
        percentiles' accuracy, and the refusals (a sharded run keeps no request's record).

Pure: no executor, no engine.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.config import Deployment, Workload
from inference_lab.errors import ConfigError
from inference_lab.sim.sketch import QuantileSketch
from inference_lab.traffic.traces import Trace

__all__ = [
    "STATE_BLIND",
    "FleetInfo",
    "SessionFigures",
    "ShardTiming",
    "TurnFigures",
    "check_shardable",
    "draws",
    "route",
]

#: The routers whose answer reads no replica (router Rule 3): what a shard can follow.
STATE_BLIND = ("round_robin", "random", "session_affinity")
_MASK = (1 << 64) - 1
_U = np.uint64


def draws(seed: int, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """``router.draw(seed, k)`` for every ``k`` of ``keys`` (>= 0), over arrays: the same
    SplitMix64 outputs, uint64 arithmetic wrapping as the scalar one masks."""
    with np.errstate(over="ignore"):
        z = _U(seed & _MASK) + (keys.astype(np.uint64) + _U(1)) * _U(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U(30))) * _U(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U(27))) * _U(0x94D049BB133111EB)
        return z ^ (z >> _U(31))


def route(deployment: Deployment, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The worker (the deployment's index) its router gives each key (Rule 1): an
    arrival's index among those the deployment can run, or a session's id
    (``session_affinity``)."""
    hw = deployment.hardware
    workers = deployment.workers
    if hw.router == "round_robin":
        return keys % workers
    return (draws(hw.router_seed, keys) % _U(workers)).astype(np.int64)


#: Why a router cannot be sharded: what it reads of every replica at each arrival.
_READS = {
    "least_loaded": "every replica's load",
    "prefix_affinity": "every replica's load and prefix cache",
    "kv_aware": "every replica's prefix cache and queued prefill",
}


@attrs.frozen(kw_only=True)
class ShardTiming:
    """How and where a shard ran (nothing of its answer depends on it): its wall and CPU
    seconds, the CPU seconds of its first pass over the arrival stream, its host:pid."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    select_cpu_s: float = 0.0
    host: str = ""

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True, eq=False)
class TurnFigures:
    """A shard's completed turns of one index: count, TTFT sketch (ms), token sums."""

    turn: int
    requests: int
    ttft: QuantileSketch
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen(kw_only=True, eq=False)
class SessionFigures:
    """A session shard's table (``sim.shard_sessions`` Rule 3): its sessions with a
    completed turn, its turns by index, the arrival time of its first refusal (inf:
    none)."""

    sessions: int
    by_turn: tuple[TurnFigures, ...]
    first_refusal_time: float


@attrs.frozen(kw_only=True)
class FleetInfo:
    """How a sharded run ran and what of it is not exact (Rule 4)."""

    replicas: int  # the deployment's
    shards: int
    parallelism: int  # jobs the executor ran at once
    relative_accuracy: float  # of the percentiles
    timings: tuple[ShardTiming, ...]  # each shard's, in shard order
    refusals: tuple[tuple[str, int], ...]  # requests that can never run, by limit
    first_refusal: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "shards": self.shards,
            "parallelism": self.parallelism,
            "percentiles": "merged quantile sketches",
            "relative_accuracy": self.relative_accuracy,
            "peak_waiting": "sum of the shards' peaks (an upper bound)",
            "refusals": dict(self.refusals),
            "shards_ran": [t.to_dict() for t in self.timings],
        }


def check_shardable(deployment: Deployment, workload: Workload | Trace) -> None:
    """Raise ConfigError, one line, when the run cannot be sharded (Rule 1)."""
    router = deployment.hardware.router
    if router in _READS:
        raise ConfigError(
            f"--ray: router {router} cannot be sharded: it reads {_READS[router]} at each "
            "arrival, which no shard sees (round_robin, random and session_affinity can)"
        )
    if isinstance(workload, Workload):
        _check_workload(router, workload)
    if deployment.scheduler.max_waiting:
        raise ConfigError(
            "--ray: max_waiting bounds the waiting places of all replicas together, which "
            "no shard sees; shard with --max-waiting 0"
        )
    if deployment.disaggregation is not None:
        raise ConfigError(
            "--ray: a disaggregated deployment cannot be sharded: every decode replica "
            "takes hand-offs from every prefill replica"
        )
    if deployment.lora is not None:
        raise ConfigError(
            "--ray: LoRA adapters are not sharded yet (a shard returns no adapter counters); "
            "run without --ray"
        )
    if deployment.scheduler.kv_offloading_size:
        raise ConfigError(
            "--ray: KV tiers are not sharded yet (a shard returns no tier counters); "
            "run without --ray or without kv_offloading_size"
        )
    if deployment.speculative is not None:
        raise ConfigError(
            "--ray: speculative decoding cannot be sharded: its acceptance draws come from "
            "one generator shared by every replica, in the deployment's event order"
        )


def _check_workload(router: str, workload: Workload) -> None:
    """The workloads whose arrivals depend on other replicas' progress (Rule 1)."""
    if workload.sessions is not None and workload.arrival_pattern == "closed_loop":
        raise ConfigError(
            "--ray: closed-loop sessions cannot be sharded: each user's next session is "
            "drawn in the order sessions start across the deployment, which follows every "
            "replica's progress"
        )
    if workload.sessions is not None and router != "session_affinity":
        raise ConfigError(
            f"--ray: a session workload under {router} cannot be sharded: a turn is sent "
            "when its previous answer ends, so its place among the deployment's arrivals "
            "depends on every replica's progress (session_affinity keeps a session's "
            "turns on one replica, and can)"
        )
    if workload.arrival_pattern == "closed_loop":
        raise ConfigError(
            "--ray: a closed-loop workload cannot be sharded: each request's lengths are "
            "the next in one stream, in the order the users send, which follows every "
            "replica's progress (whatever the router)"
        )
