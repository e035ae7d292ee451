"""Prefill/decode disaggregation: a deployment split into a prefill pool and a decode pool.

A model config's ``[disaggregation]`` table (or ``--pd xPyD`` on the command line) splits
a deployment in two pools of replicas, each an entry of the config with its own replica
count, parallelism and scheduler overrides: requests are prefilled in the prefill pool,
their KV cache is carried to a decode replica over the link between the pools, and they
decode there (``docs/disaggregation.md``).

Rule 1: each pool is a deployment checked as a config entry is (parallelism, fit, KV
        blocks): the entry it names (default: the deployment's own), with its ``replicas``,
        ``tp`` and ``[...scheduler]`` keys over the entry's.
Rule 2: the link is the hardware profile's fabric: ``scale_up`` (NVLink) when both pools
        fit in one node (``link = "auto"`` and prefill GPUs + decode GPUs <= the node's
        GPUs, or ``link = "scale_up"``), else ``scale_out`` (the NICs); a transfer moves
        over ``min(prefill tp, decode tp)`` GPU links at once (each tensor-parallel rank
        sends its shard of the heads).
Rule 3: not modelled, and refused at load time: speculative decoding and data-parallel
        attention ranks in either pool.
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_lab.core.config.checks import ge, le, lowercase, one_of
from inference_lab.core.config.hardware import Link

__all__ = [
    "DECODE_ROUTERS",
    "LINKS",
    "DisaggregationConfig",
    "PoolConfig",
    "transfer_seconds",
]

#: How the decode pool's replica is chosen: the prefill routers' round robin and least
#: loaded, or ``kv_free`` (the most free KV blocks, then the least loaded): what a P/D
#: gateway's decode scorer does.
DECODE_ROUTERS = ("round_robin", "least_loaded", "kv_free")
#: The ``link`` choices (Rule 2).
LINKS = ("auto", "scale_up", "scale_out")


@attrs.frozen(kw_only=True)
class PoolConfig:
    """One pool of ``[disaggregation]`` (``prefill`` or ``decode``), as written."""

    #: the ``[hardware.<name>]`` entry the pool runs (None: the deployment's own)
    hardware: str | None = None
    replicas: int = attrs.field(default=1, validator=[ge(1), le(1024)])
    #: tensor parallelism (None: the entry's)
    tp: int | None = attrs.field(default=None, validator=attrs.validators.optional(ge(1)))
    #: the router over the pool's replicas (None: least_loaded)
    router: str | None = attrs.field(default=None, converter=attrs.converters.optional(lowercase))
    #: scheduler keys over the entry's (e.g. the prefill pool's max_num_batched_tokens)
    scheduler: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class DisaggregationConfig:
    """``[disaggregation]`` as written (resolved into :class:`Disaggregation`)."""

    prefill: PoolConfig = attrs.field(factory=PoolConfig)
    decode: PoolConfig = attrs.field(factory=PoolConfig)
    link: str = attrs.field(default="auto", converter=lowercase, validator=one_of(LINKS))
    #: the transfer overlaps the prefill layer by layer (LMCache, Mooncake push); False:
    #: the decode pool pulls the KV after the prefill has finished (vLLM's NixlConnector)
    overlap: bool = False
    #: seconds between the prefill's answer and the decode request (the proxy's hop)
    handoff_latency: float = attrs.field(default=0.0, validator=[ge(0), le(60)])


def transfer_seconds(
    link: Link, streams: int, kv_bytes: float, *, overlap: bool, layers: int, overlapped: float
) -> float:
    """The seconds a KV transfer of ``kv_bytes`` shows over ``link`` on ``streams`` GPU
    links at once: its latency plus the bytes over the links; with ``overlap`` (the
    transfer pushed layer by layer as the prefill computes), only what the prefill's last
    ``overlapped`` seconds did not hide, and never less than one of its ``layers`` layers'
    share. 0 for nothing to move."""
    if kv_bytes <= 0:
        return 0.0
    wire = kv_bytes / (link.bandwidth * streams)
    if not overlap:
        return link.latency + wire
    return link.latency + max(wire / max(1, layers), wire - overlapped)
