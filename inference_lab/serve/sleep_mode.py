"""vLLM's sleep mode, priced: what ``POST /sleep`` frees and how long it and ``/wake_up``
take.

vLLM's level 1 offloads the model's weights to the host's memory and discards the KV
cache; level 2 discards both (the weights are then reloaded, or an RL trainer sends new
ones). Neither frees anything here -- no GPU is held -- but the time each step takes is
what a client of a real server waits for, so the routes wait for it
(:mod:`inference_lab.serve.ops`).

Rule 1: moving the weights costs ``resident weight bytes / (GPUs x rate)``: every GPU of a
        replica moves its share at once, and replicas move in parallel. Level 1's sleep
        and its wake-up move them over the host link (:data:`HOST_LINK_BYTES_PER_S`, pinned
        host memory); level 2's sleep discards them at no cost and its wake-up reloads
        them from the host's storage (:data:`RELOAD_BYTES_PER_S`, the page cache or a
        local NVMe drive).
Rule 2: the KV cache is discarded at sleep and allocated again at wake-up at no cost; its
        contents (the prefix cache) are gone either way.
Rule 3: a wake-up may name what it restores (``tags``: ``weights``, ``kv_cache``), as
        vLLM's does; the model admits requests again once both are back.
"""

from __future__ import annotations

from collections.abc import Collection

from inference_lab.core.config import Deployment

__all__ = [
    "HOST_LINK_BYTES_PER_S",
    "RELOAD_BYTES_PER_S",
    "TAGS",
    "sleep_seconds",
    "wake_seconds",
]

#: Bytes per second one GPU moves to or from pinned host memory: PCIe 5.0 x16's 64 GB/s per
#: direction less protocol overhead (an assumption of the model, not a measurement).
HOST_LINK_BYTES_PER_S = 50e9
#: Bytes per second one GPU reloads weights at from the host's storage (page cache or a
#: local NVMe drive, through pageable memory): an assumption of the model.
RELOAD_BYTES_PER_S = 10e9
#: What a wake-up may restore (Rule 3).
TAGS = ("weights", "kv_cache")


def _move(deployment: Deployment, rate: float) -> float:
    return deployment.resident_weight_bytes / (deployment.hardware.tp * rate)


def sleep_seconds(deployment: Deployment, level: int) -> float:
    """How long ``POST /sleep`` at ``level`` takes for ``deployment`` (Rule 1)."""
    return _move(deployment, HOST_LINK_BYTES_PER_S) if level == 1 else 0.0


def wake_seconds(deployment: Deployment, level: int, tags: Collection[str]) -> float:
    """How long a wake-up restoring ``tags`` after a sleep at ``level`` takes (Rules 1-3);
    the KV cache costs nothing."""
    if "weights" not in tags:
        return 0.0
    rate = HOST_LINK_BYTES_PER_S if level == 1 else RELOAD_BYTES_PER_S
    return _move(deployment, rate)
