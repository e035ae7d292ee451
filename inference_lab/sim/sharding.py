"""What may be sharded (``inference-lab sim --ray``), and how a sharded run says what it
did: the rules of :mod:`inference_lab.sim.fleet` that the rest of the simulator reads.

Rule 1: a deployment is sharded only when its replicas can be simulated apart: its
        router must send each arrival to a replica whatever the replicas' state
        (``round_robin``: the ``k``-th arrival to worker ``k mod W``), the workload's
        arrivals must not depend on completions (an open loop: poisson, uniform, burst,
        batched), ``max_waiting`` must be 0 (it bounds the waiting places of all
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

from inference_lab.core.config import Deployment, Workload
from inference_lab.errors import ConfigError
from inference_lab.traffic.traces import Trace

__all__ = ["FleetInfo", "ShardTiming", "check_shardable"]

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
    hw = deployment.hardware
    if hw.router in _READS:
        raise ConfigError(
            f"--ray: router {hw.router} cannot be sharded: it reads {_READS[hw.router]} at "
            "each arrival, which no shard sees (round_robin can)"
        )
    if isinstance(workload, Trace):
        raise ConfigError("--ray: traces are not sharded; shards take an open-loop workload")
    if workload.sessions is not None or workload.arrival_pattern == "closed_loop":
        what = "a turn" if workload.sessions is not None else "a user's next request"
        raise ConfigError(
            f"--ray: a {'session' if workload.sessions is not None else 'closed-loop'} "
            f"workload cannot be sharded: {what} is sent when an answer ends, so the replica "
            "round robin gives it depends on every replica's progress"
        )
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
