"""The scheduler's engine arguments (``[scheduler]``, and an entry's override of it).

Rule 1: a class is valid at construction or raises a FieldError naming the field; the
        policy is matched case-insensitively (``FCFS`` is ``fcfs``).
"""

from __future__ import annotations

import attrs

from inference_lab.core.config.checks import ge, gt, le, lowercase, one_of

__all__ = ["POLICIES", "SchedulerConfig"]

POLICIES = ("fcfs", "priority", "sjf", "ljf")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    max_num_batched_tokens: int = attrs.field(validator=ge(1))
    max_num_seqs: int = attrs.field(validator=ge(1))
    max_waiting: int = attrs.field(default=0, validator=ge(0))
    policy: str = attrs.field(default="fcfs", converter=lowercase, validator=one_of(POLICIES))
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = attrs.field(default=0, validator=ge(0))
    block_size: int = attrs.field(default=16, validator=ge(1))
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=[gt(0), le(1)])
    kv_cache_capacity: float = attrs.field(default=0, validator=ge(0))
    #: Keep finished requests' full blocks cached and reuse them for requests that carry
    #: the same block hashes (vLLM's automatic prefix caching; on by default there too).
    enable_prefix_caching: bool = True
    #: With prefix caching: hash every request's blocks, as vLLM does, so a request the
    #: workload gives no hash chain (a synthetic workload's unique prompt) finds its own
    #: computed blocks again after a preemption instead of recomputing them (the KV cache
    #: manager's Rule 5; docs/fidelity.md). Off by default: such a request recomputes.
    hash_every_prompt: bool = False
    #: Seconds from a request's arrival to its entering the engine: a real server's API
    #: process (parsing, tokenising, handing over to the engine). Counted in TTFT and E2E.
    frontend_latency: float = attrs.field(default=0.0, validator=[ge(0), le(60)])
    #: GiB of host DRAM for KV blocks evicted from HBM, per replica (vLLM's
    #: ``kv_offloading_size``; 0: no host tier; bounded by the profile's ``[host] memory``
    #: x tp, checked by the loader: docs/kv-tiers.md)
    kv_offloading_size: float = attrs.field(default=0.0, validator=[ge(0), le(1 << 20)])
    #: GiB of local NVMe or a shared store behind the host tier, per replica (0: none)
    kv_offloading_disk_size: float = attrs.field(default=0.0, validator=[ge(0), le(1 << 30)])
    #: the disk tier's read bandwidth (bytes/s) and latency (s)
    kv_offloading_disk_bandwidth: float = attrs.field(default=6.0e9, validator=[gt(0), le(1e13)])
    kv_offloading_disk_latency: float = attrs.field(default=1.0e-4, validator=[ge(0), le(10)])
