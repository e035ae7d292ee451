"""Hardware: a GPU's profile (``hardware_profiles/<name>.toml``), a model's
``[hardware.<name>]`` entries, efficiency terms, links and the fabric.

Rule 1: a class is valid at construction or raises a FieldError naming the field.
Rule 2: the default efficiency (1.0, no overhead) is the datasheet roofline itself; an
        entry's ``efficiency`` replaces only the keys it sets.
Rule 3: what depends on a model as well (parallelism dividing, a fabric for tp > 1, the
        fit) is checked by the loader on the whole deployment, not here.
"""

from __future__ import annotations

import attrs

from inference_lab.core.config.checks import (
    ge,
    gt,
    le,
    lowercase,
    one_of,
    optional_name,
    optional_nonempty,
)

__all__ = [
    "Overheads",
    "ROUTERS",
    "Efficiency",
    "EfficiencyOverride",
    "Fabric",
    "HardwareEntry",
    "HardwareProfile",
    "HostLink",
    "Link",
    "TimeCorrection",
]

ROUTERS = (
    "round_robin",
    "least_loaded",
    "prefix_affinity",
    "kv_aware",
    "random",
    "session_affinity",
)


@attrs.frozen(kw_only=True)
class TimeCorrection:
    alpha: float = attrs.field(default=1.0, validator=gt(0))
    beta: float = attrs.field(default=0.0, validator=ge(0))


@attrs.frozen(kw_only=True)
class Efficiency:
    """Where a real engine falls short of the datasheet roofline (docs/fidelity.md):
    the achievable fraction of HBM bandwidth and of peak FLOP/s, a fixed overhead per
    step (scheduler, kernel launches, sampling) and one per transformer layer per step
    (the layer's kernels and tensor-parallel synchronisation, whatever the batch). The
    defaults are the roofline itself."""

    memory_bandwidth: float = attrs.field(default=1.0, validator=[gt(0), le(1)])
    flops: float = attrs.field(default=1.0, validator=[gt(0), le(1)])
    step_overhead: float = attrs.field(default=0.0, validator=[ge(0), le(1)])
    #: the Zipf exponent of the MoE experts' popularity (the roofline's Rule 8; 0: uniform)
    expert_skew: float = attrs.field(default=0.0, validator=[ge(0), le(4)])
    #: seconds each transformer layer adds to every step (the roofline's Rule 9; 0: none)
    layer_overhead: float = attrs.field(default=0.0, validator=[ge(0), le(0.01)])

    @property
    def is_identity(self) -> bool:
        return (
            self.memory_bandwidth == 1.0
            and self.flops == 1.0
            and self.step_overhead == 0.0
            and self.expert_skew == 0.0
            and self.layer_overhead == 0.0
        )


@attrs.frozen(kw_only=True)
class EfficiencyOverride:
    """A hardware entry's ``efficiency`` table: the keys it sets replace the profile's."""

    memory_bandwidth: float | None = attrs.field(default=None, validator=[gt(0), le(1)])
    flops: float | None = attrs.field(default=None, validator=[gt(0), le(1)])
    step_overhead: float | None = attrs.field(default=None, validator=[ge(0), le(1)])
    expert_skew: float | None = attrs.field(default=None, validator=[ge(0), le(4)])
    layer_overhead: float | None = attrs.field(default=None, validator=[ge(0), le(0.01)])

    def over(self, base: Efficiency) -> Efficiency:
        changes = {
            a.name: getattr(self, a.name)
            for a in attrs.fields(EfficiencyOverride)
            if getattr(self, a.name) is not None
        }
        return attrs.evolve(base, **changes) if changes else base


@attrs.frozen(kw_only=True)
class Overheads:
    """What the engine's host side adds (docs/fidelity.md): its per-request work each step
    (preparing inputs, sampling, detokenising and streaming one token) costs
    ``seq_overhead`` seconds per sequence in the step, its API process
    ``frontend_latency`` seconds per request before the request reaches the engine (added
    to the scheduler's ``frontend_latency`` of every entry on the profile, when the entry
    is loaded), and ``reserved_memory`` bytes of each GPU's memory pool hold no KV cache
    (the CUDA context, activation workspace, CUDA graphs, communication buffers). The
    defaults, 0, are the roofline itself."""

    seq_overhead: float = attrs.field(default=0.0, validator=[ge(0), le(0.01)])
    frontend_latency: float = attrs.field(default=0.0, validator=[ge(0), le(10)])
    reserved_memory: float = attrs.field(default=0.0, validator=ge(0))
    #: The KV capacity as vLLM sizes it (docs/fidelity.md#the-kv-capacity-as-vllm-computes-it),
    #: all off by default: hold each stream's block scales (``scale_block``) beside its
    #: weights; round the routed experts' hidden and intermediate widths up to these
    #: multiples (the MoE kernels' tile sizes); keep back the profile run's peak.
    weight_scales: bool = False
    expert_hidden_multiple: int = attrs.field(default=1, validator=ge(1))
    expert_intermediate_multiple: int = attrs.field(default=1, validator=ge(1))
    profile_run: bool = False


@attrs.frozen(kw_only=True)
class HardwareEntry:
    #: The hardware profile's file name (``hardware_profiles/<profile>.toml``); None: the
    #: entry's own name. Lets one model have several entries on one GPU (tp variants,
    #: calibrated ones).
    profile: str | None = attrs.field(default=None, validator=optional_name)
    tp: int = attrs.field(default=1, validator=ge(1))
    #: Expert parallelism: the MoE layers' experts spread over ``ep`` GPUs, tokens sent to
    #: them and back by all-to-all (dispatch, combine) instead of an all-reduce.
    ep: int = attrs.field(default=1, validator=ge(1))
    #: Data-parallel attention: a replica's ``tp`` GPUs form ``dp_attention`` ranks of
    #: ``tp / dp_attention`` GPUs, each with the attention and dense weights, its own
    #: scheduler and KV cache (a worker); the ranks step in lockstep and share the experts.
    dp_attention: int = attrs.field(default=1, validator=ge(1))
    replicas: int = attrs.field(default=1, validator=ge(1))
    router: str = attrs.field(default="round_robin", converter=lowercase, validator=one_of(ROUTERS))
    #: prefix_affinity: a replica is eligible while its load (running + waiting) is
    #: below ceil(ratio * (total load + 1) / replicas).
    affinity_load_ratio: float = attrs.field(default=1.25, validator=ge(1))
    #: kv_aware: the weight of a replica's queued prefill tokens against the request's
    #: own uncached prompt tokens.
    kv_aware_queue_weight: float = attrs.field(default=1.0, validator=ge(0))
    #: random, session_affinity: the seed of their draws (core/engine/router.py, Rule 3).
    router_seed: int = attrs.field(default=0, validator=ge(0))
    time_correction: TimeCorrection = attrs.field(factory=TimeCorrection)
    #: Replaces the profile's ``[efficiency]`` keys it sets, for this model only.
    efficiency: EfficiencyOverride | None = None
    #: Replaces the profile's ``[overheads]`` table, for this model only.
    overheads: Overheads | None = None
    #: A CSV of measured step times (docs/fidelity.md#measured-step-tables), relative to
    #: the config file; after loading, the resolved path.
    step_table: str | None = attrs.field(default=None, validator=optional_nonempty)


# ---------------------------------------------------------------------------------------
# hardware profile


@attrs.frozen(kw_only=True)
class Link:
    bandwidth: float = attrs.field(validator=gt(0))
    latency: float = attrs.field(validator=ge(0))
    in_network_reduction: bool = False


@attrs.frozen(kw_only=True)
class Fabric:
    gpus_per_node: int = attrs.field(validator=ge(1))
    scale_up: Link
    scale_out: Link | None = None


@attrs.frozen(kw_only=True)
class HostLink:
    """``[host]`` of a profile: the link between one GPU and host memory (PCIe, or
    NVLink-C2C on Grace), per direction, and the host DRAM one GPU's share of a node has
    (the bound on a host KV tier: ``docs/kv-tiers.md``)."""

    bandwidth: float = attrs.field(validator=gt(0))
    latency: float = attrs.field(validator=ge(0))
    memory: float = attrs.field(validator=gt(0))


@attrs.frozen(kw_only=True)
class HardwareProfile:
    name: str
    flops_fp4: float | None = attrs.field(default=None, validator=gt(0))
    flops_fp8: float | None = attrs.field(default=None, validator=gt(0))
    flops_bf16: float | None = attrs.field(default=None, validator=gt(0))
    flops_fp16: float | None = attrs.field(default=None, validator=gt(0))
    memory_bandwidth: float = attrs.field(validator=gt(0))
    memory_capacity: float = attrs.field(validator=gt(0))
    fabric: Fabric | None = None
    #: the link to host memory, for KV offloading (None: the profile says nothing)
    host: HostLink | None = None
    efficiency: Efficiency = attrs.field(factory=Efficiency)
    overheads: Overheads = attrs.field(factory=Overheads)
    #: The profile this one was layered on (``base = "h100"``), for display; None for a
    #: datasheet profile.
    base: str | None = attrs.field(default=None, validator=optional_name)

    def flops(self, precision: str) -> float | None:
        """FLOP/s of one GPU at ``precision`` (fp32 is fp16 / 2), or None if absent."""
        if precision == "fp32":
            return None if self.flops_fp16 is None else self.flops_fp16 / 2
        value: float | None = getattr(self, f"flops_{precision}")
        return value
