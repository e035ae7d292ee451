"""Configuration: model configs, hardware profiles, workloads.

Rule 1: every file goes through one strict cattrs converter (built by
        :mod:`inference_lab.validation`) into ``@attrs.frozen`` classes. Unknown keys are
        errors; scalars are never coerced (``7.9`` is not an int, ``"false"`` is not a
        bool; an int is accepted where a float is expected).
Rule 2: every error is a :class:`ConfigError` whose message is one line naming the file and
        the key path (``configs/x.toml: scheduler.max_num_seqs: must be >= 1, got 0``).
Rule 3: a model config is valid as a whole or not at all: every ``[hardware.*]`` entry is
        resolved against its profile and checked (parallelism, precisions, fit, KV blocks)
        at load time, never later at run time.
Rule 4: every file a config points at (a profile's ``base``, an entry's ``step_table``) is
        read here, by the loader, so the engine and the roofline never do I/O; the
        defaults (efficiency 1.0, no overhead, no step table) price every step exactly as
        the datasheet roofline does.
"""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
from cattrs.errors import ForbiddenExtraKeysError

from inference_lab.core.step_table import StepTable, parse_step_table
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir
from inference_lab.traffic.schedules import (
    PiecewiseRate,
    RateSchedule,
    SineRate,
    SquareRate,
    check_points,
)
from inference_lab.validation import (
    FieldError,
    Invalid,
    error_leaves,
    join_path,
    make_strict_converter,
)

BYTES_PER_VALUE: dict[str, float] = {"fp4": 0.5, "fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}
PRECISIONS = tuple(BYTES_PER_VALUE)
POLICIES = ("fcfs", "priority", "sjf", "ljf")
ROUTERS = ("round_robin", "least_loaded", "prefix_affinity", "kv_aware")
ARRIVAL_PATTERNS = ("poisson", "uniform", "burst", "batched", "closed_loop")

T = TypeVar("T")


# ---------------------------------------------------------------------------------------
# validators (messages are the tail of "file: key.path: <message>")


def _ge(lo: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not value >= lo:  # (NaN too)
            raise FieldError(attr.name, f"must be >= {lo}, got {value!r}")

    return check


def _gt(lo: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not value > lo:
            raise FieldError(attr.name, f"must be > {lo}, got {value!r}")

    return check


def _le(hi: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not value <= hi:  # (NaN too)
            raise FieldError(attr.name, f"must be <= {hi}, got {value!r}")

    return check


def _one_of(options: tuple[str, ...]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value not in options:
            raise FieldError(attr.name, f"must be one of {', '.join(options)}; got {value!r}")

    return check


def _optional_nonempty(_inst: Any, attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value:
        raise FieldError(attr.name, "must be a non-empty path")


def _optional_name(_inst: Any, attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value:
        raise FieldError(attr.name, "must be a non-empty name")


def _lower(value: str) -> str:
    return value.lower() if isinstance(value, str) else value


def _nonempty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if len(value) == 0:
        raise FieldError(attr.name, "must have at least one entry")


# ---------------------------------------------------------------------------------------
# model config


@attrs.frozen(kw_only=True)
class Routing:
    routed_experts: int = attrs.field(validator=_ge(1))
    experts_per_tok: int = attrs.field(validator=_ge(1))
    moe_layers: int = attrs.field(validator=_ge(1))


@attrs.frozen(kw_only=True)
class WeightStream:
    precision: str = attrs.field(validator=_one_of(PRECISIONS))
    active_params: float = attrs.field(validator=_gt(0))
    resident_params: float = attrs.field()
    routing: Routing | None = None

    @resident_params.validator
    def _check_resident(self, attr: attrs.Attribute[Any], value: float) -> None:
        if value < self.active_params:
            raise FieldError(
                attr.name, f"must be >= active_params ({self.active_params:g}), got {value:g}"
            )

    @property
    def resident_bytes(self) -> int:
        return math.floor(self.resident_params * BYTES_PER_VALUE[self.precision])

    @property
    def expert_params(self) -> float:
        """The routed experts' parameters, ``E * per_expert`` with ``per_expert = (resident
        - active) / (E - k)`` (0 without routing, or when every expert is active): what
        expert parallelism shards; the rest is the stream's dense part."""
        r = self.routing
        if r is None or r.routed_experts <= r.experts_per_tok:
            return 0.0
        per_expert = (self.resident_params - self.active_params) / (
            r.routed_experts - r.experts_per_tok
        )
        return r.routed_experts * per_expert


@attrs.frozen(kw_only=True)
class AttentionLayer:
    kind: str = attrs.field(default="attention")
    count: int = attrs.field(validator=_ge(1))
    heads: int = attrs.field(validator=_ge(1))
    head_dim: int = attrs.field(validator=_ge(1))
    kv_heads: int = attrs.field(validator=_ge(1))
    kv_precision: str = attrs.field(default="bf16", validator=_one_of(PRECISIONS))
    kv_shared: bool = False
    window: int = attrs.field(default=0, validator=_ge(0))

    @property
    def kv_bytes_per_position(self) -> float:
        return (
            (1 if self.kv_shared else 2)
            * self.kv_heads
            * self.head_dim
            * BYTES_PER_VALUE[self.kv_precision]
        )


@attrs.frozen(kw_only=True)
class MLALayer:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one latent vector
    of ``kv_latent_dim`` plus a shared rope key of ``rope_dim`` per position, whatever the
    head count. Decode steps compute in the absorbed form (multi-query attention over the
    latent), prefill chunks in the expanded form (the latent up-projected to ``heads``
    keys and values); ``docs/internals.md`` gives the FLOPs of both. ``q_latent_dim`` is
    the query's low-rank dimension (``q_lora_rank``, 0: none): recorded, it enters no
    cost (the projections are parameters of the weight streams)."""

    kind: str = attrs.field(default="mla")
    count: int = attrs.field(validator=_ge(1))
    heads: int = attrs.field(validator=_ge(1))
    kv_latent_dim: int = attrs.field(validator=_ge(1))
    rope_dim: int = attrs.field(default=0, validator=_ge(0))
    qk_nope_dim: int = attrs.field(validator=_ge(1))
    v_head_dim: int = attrs.field(validator=_ge(1))
    q_latent_dim: int = attrs.field(default=0, validator=_ge(0))
    kv_precision: str = attrs.field(default="bf16", validator=_one_of(PRECISIONS))
    window: int = attrs.field(default=0, validator=_ge(0))

    @property
    def kv_bytes_per_position(self) -> float:
        """Bytes one GPU holding this layer's cache keeps per position: the latent and the
        rope key (replicated on every GPU of an attention group: ``Deployment``)."""
        return (self.kv_latent_dim + self.rope_dim) * BYTES_PER_VALUE[self.kv_precision]


@attrs.frozen(kw_only=True)
class LinearLayer:
    kind: str = attrs.field(default="linear")
    count: int = attrs.field(validator=_ge(1))
    state_bytes: int = attrs.field(validator=_ge(0))


Layer = AttentionLayer | MLALayer | LinearLayer
#: The layer kinds that keep a KV cache per position.
KV_LAYERS = (AttentionLayer, MLALayer)

#: Reasoning efforts a request may ask for (``none``: no reasoning tokens).
EFFORTS = ("none", "minimal", "low", "medium", "high")


@attrs.frozen(kw_only=True)
class ReasoningConfig:
    """``[model.reasoning]``: the model reasons (gpt-oss, Qwen3 thinking). Each ratio is
    the share of a chat / Responses answer's output tokens spent reasoning at that
    effort; ``default_effort`` applies when a request names none. Used by the serve
    API only (``docs/agents.md``); the engine counts every output token alike."""

    default_effort: str = attrs.field(default="medium", validator=_one_of(EFFORTS))
    minimal: float = attrs.field(default=0.1, validator=[_ge(0), _le(0.95)])
    low: float = attrs.field(default=0.2, validator=[_ge(0), _le(0.95)])
    medium: float = attrs.field(default=0.5, validator=[_ge(0), _le(0.95)])
    high: float = attrs.field(default=0.8, validator=[_ge(0), _le(0.95)])

    def ratio(self, effort: str) -> float:
        """The share of output tokens spent reasoning at ``effort`` (0 for ``none``)."""
        return 0.0 if effort == "none" else float(getattr(self, effort))


@attrs.frozen(kw_only=True)
class ModelArch:
    name: str = attrs.field(validator=attrs.validators.min_len(1))
    hidden_dim: int = attrs.field(validator=_ge(1))
    max_seq_len: int = attrs.field(validator=_ge(2))
    attention_precision: str = attrs.field(default="bf16", validator=_one_of(PRECISIONS))
    activation_bytes: int = attrs.field(default=2, validator=_ge(1))
    weights: tuple[WeightStream, ...] = attrs.field(validator=_nonempty)
    layers: tuple[Layer, ...] = attrs.field(validator=_nonempty)
    #: A tokenizer file (``tokenizer.json``, a ``.tiktoken`` rank file, or a directory
    #: holding ``tokenizer.json``) written relative to the config file; after loading,
    #: the resolved path. None: prompts are counted by the byte rule.
    tokenizer: str | None = attrs.field(default=None, validator=_optional_nonempty)
    #: ``[model.reasoning]``: part of each chat answer is reasoning (None: none is).
    reasoning: ReasoningConfig | None = None

    @layers.validator
    def _check_full_attention(self, attr: attrs.Attribute[Any], value: tuple[Layer, ...]) -> None:
        if not any(isinstance(layer, KV_LAYERS) and layer.window == 0 for layer in value):
            raise FieldError(
                attr.name,
                "needs at least one full-context attention class (window = 0); "
                "the KV block size is defined by those layers",
            )

    @property
    def num_layers(self) -> int:
        return sum(layer.count for layer in self.layers)

    @property
    def resident_weight_bytes(self) -> int:
        return sum(w.resident_bytes for w in self.weights)

    @property
    def moe_layers(self) -> int:
        """The MoE layers of the routed streams (the largest ``moe_layers``; 0 without
        routing): where expert parallelism exchanges tokens."""
        return max((w.routing.moe_layers for w in self.weights if w.routing is not None), default=0)


@attrs.frozen(kw_only=True)
class DraftWeightStream(WeightStream):
    """A drafter's weight stream: as a model's, except that ``resident_params`` counts
    only what the drafter adds to HBM. A drafter that reuses the target's embedding and
    lm_head reads them (``active_params``) without holding them a second time."""

    resident_params: float = attrs.field(validator=_ge(0))


#: How a drafter's work is priced (``docs/configuration.md#speculative``).
DRAFTER_KINDS = ("fraction", "model", "mtp")
#: The most draft tokens per step a config may ask for.
MAX_SPECULATIVE_TOKENS = 16


@attrs.frozen(kw_only=True)
class DrafterConfig:
    """``[speculative.drafter]``: what proposing the draft tokens costs.

    ``fraction``: each of a step's draft tokens costs ``fraction`` of the target's step over
    the same batch without drafts. ``model`` (a small draft model, EAGLE heads) and ``mtp``
    (the target's own multi-token-prediction layers): ``weights`` and ``layers`` priced by
    the roofline, one pass per draft token. Their weights add to the replica's resident
    weights and their KV layers to every KV block."""

    kind: str = attrs.field(validator=_one_of(DRAFTER_KINDS))
    fraction: float | None = attrs.field(default=None, validator=[_gt(0), _le(1)])
    weights: tuple[DraftWeightStream, ...] = ()
    layers: tuple[Layer, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.kind == "fraction":
            if self.fraction is None:
                raise FieldError("fraction", "is required when kind = fraction")
            if self.weights or self.layers:
                raise FieldError("weights", "applies to kind model or mtp, not fraction")
            return
        if self.fraction is not None:
            raise FieldError("fraction", f"applies to kind fraction, not {self.kind}")
        if not self.weights:
            raise FieldError("weights", f"kind {self.kind} needs at least one weight stream")
        for i, w in enumerate(self.weights):
            if w.routing is not None and w.resident_params < w.active_params:
                raise FieldError(
                    "weights",
                    f"[{i}]: a routed stream's resident_params must be >= active_params",
                )
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, KV_LAYERS) or layer.window != 0:
                raise FieldError(
                    "layers", f"[{i}]: a drafter's layers must be full-context attention or mla"
                )


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """``[speculative]``: speculative decoding (off without the table).

    Each decode step of a sequence verifies ``num_speculative_tokens`` (gamma) draft tokens:
    it computes ``1 + gamma`` positions and advances by ``1 + accepted``. How many are
    accepted is drawn from the engine's own generator (seeded by ``seed``) with one of:
    a constant per-token rate ``acceptance_rate`` (alpha: position ``j`` is accepted with
    probability alpha^j), per-position rates ``acceptance_rates`` (vLLM's per-position
    acceptance rates: the share of drafts whose position ``j`` was accepted), or
    ``acceptance_file``, a CSV of measured rounds (one accepted count per line), read by
    the loader. ``gamma_by_batch`` lowers gamma as the batch grows: ``[[seqs, gamma],
    ...]``, ascending; from ``seqs`` running sequences on, ``gamma`` draft tokens."""

    method: str = attrs.field(default="eagle", validator=attrs.validators.min_len(1))
    num_speculative_tokens: int = attrs.field(validator=[_ge(1), _le(MAX_SPECULATIVE_TOKENS)])
    acceptance_rate: float | None = attrs.field(default=None, validator=[_ge(0), _le(1)])
    acceptance_rates: tuple[float, ...] | None = None
    acceptance_file: str | None = attrs.field(default=None, validator=_optional_nonempty)
    seed: int = attrs.field(default=0, validator=_ge(0))
    gamma_by_batch: tuple[tuple[int, int], ...] = ()
    drafter: DrafterConfig

    def __attrs_post_init__(self) -> None:
        given = [
            name
            for name in ("acceptance_rate", "acceptance_rates", "acceptance_file")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise FieldError(
                "acceptance_rate",
                "set exactly one of acceptance_rate, acceptance_rates, acceptance_file"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        gamma = self.num_speculative_tokens
        rates = self.acceptance_rates
        if rates is not None:
            if len(rates) != gamma:
                raise FieldError(
                    "acceptance_rates",
                    f"must have num_speculative_tokens = {gamma} entries, got {len(rates)}",
                )
            check_acceptance_rates(rates, "acceptance_rates")
        last_seqs, last_gamma = 0, gamma
        for i, pair in enumerate(self.gamma_by_batch):
            if len(pair) != 2:
                raise FieldError("gamma_by_batch", f"[{i}]: must be a pair [seqs, gamma]")
            seqs, g = pair
            if seqs <= last_seqs:
                raise FieldError("gamma_by_batch", f"[{i}]: seqs must ascend from 1, got {seqs}")
            if not 0 <= g <= last_gamma:
                raise FieldError(
                    "gamma_by_batch",
                    f"[{i}]: gamma must be in 0..{last_gamma} (never rising), got {g}",
                )
            last_seqs, last_gamma = seqs, g

    def rates(self) -> tuple[float, ...]:
        """The per-position acceptance rates of ``acceptance_rate`` or
        ``acceptance_rates`` (a CSV's are the loader's: ``Deployment.acceptance_rates``)."""
        if self.acceptance_rates is not None:
            return tuple(self.acceptance_rates)
        if self.acceptance_rate is not None:
            alpha = self.acceptance_rate
            return tuple(alpha**j for j in range(1, self.num_speculative_tokens + 1))
        return ()

    def gamma_for(self, seqs: int) -> int:
        """The draft length for a batch of ``seqs`` running sequences (``gamma_by_batch``)."""
        gamma = self.num_speculative_tokens
        for at, g in self.gamma_by_batch:
            if seqs < at:
                break
            gamma = g
        return gamma


def check_acceptance_rates(rates: tuple[float, ...], field: str) -> None:
    """Per-position acceptance rates are shares (0..1) that never rise: a draft whose
    position ``j`` was accepted had every earlier position accepted."""
    last = 1.0
    for j, rate in enumerate(rates):
        if not 0.0 <= rate <= last:
            raise FieldError(
                field, f"[{j}]: must be in 0..{last:g} (per-position rates never rise), got {rate}"
            )
        last = rate


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    max_num_batched_tokens: int = attrs.field(validator=_ge(1))
    max_num_seqs: int = attrs.field(validator=_ge(1))
    max_waiting: int = attrs.field(default=0, validator=_ge(0))
    policy: str = attrs.field(default="fcfs", converter=_lower, validator=_one_of(POLICIES))
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = attrs.field(default=0, validator=_ge(0))
    block_size: int = attrs.field(default=16, validator=_ge(1))
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=[_gt(0), _le(1)])
    kv_cache_capacity: float = attrs.field(default=0, validator=_ge(0))
    #: Keep finished requests' full blocks cached and reuse them for requests that carry
    #: the same block hashes (vLLM's automatic prefix caching; on by default there too).
    enable_prefix_caching: bool = True
    #: Seconds from a request's arrival to its entering the engine: a real server's API
    #: process (parsing, tokenising, handing over to the engine). Counted in TTFT and E2E.
    frontend_latency: float = attrs.field(default=0.0, validator=[_ge(0), _le(60)])


@attrs.frozen(kw_only=True)
class TimeCorrection:
    alpha: float = attrs.field(default=1.0, validator=_gt(0))
    beta: float = attrs.field(default=0.0, validator=_ge(0))


@attrs.frozen(kw_only=True)
class Efficiency:
    """Where a real engine falls short of the datasheet roofline (docs/fidelity.md):
    the achievable fraction of HBM bandwidth and of peak FLOP/s, and a fixed overhead per
    step (scheduler, kernel launches, sampling). The defaults are the roofline itself."""

    memory_bandwidth: float = attrs.field(default=1.0, validator=[_gt(0), _le(1)])
    flops: float = attrs.field(default=1.0, validator=[_gt(0), _le(1)])
    step_overhead: float = attrs.field(default=0.0, validator=[_ge(0), _le(1)])

    @property
    def is_identity(self) -> bool:
        return self.memory_bandwidth == 1.0 and self.flops == 1.0 and self.step_overhead == 0.0


@attrs.frozen(kw_only=True)
class EfficiencyOverride:
    """A hardware entry's ``efficiency`` table: the keys it sets replace the profile's."""

    memory_bandwidth: float | None = attrs.field(default=None, validator=[_gt(0), _le(1)])
    flops: float | None = attrs.field(default=None, validator=[_gt(0), _le(1)])
    step_overhead: float | None = attrs.field(default=None, validator=[_ge(0), _le(1)])

    def over(self, base: Efficiency) -> Efficiency:
        changes = {
            a.name: getattr(self, a.name)
            for a in attrs.fields(EfficiencyOverride)
            if getattr(self, a.name) is not None
        }
        return attrs.evolve(base, **changes) if changes else base


@attrs.frozen(kw_only=True)
class Host:
    """What the engine's host side adds (docs/fidelity.md): its per-request work each step
    (preparing inputs, sampling, detokenising and streaming one token) costs
    ``seq_overhead`` seconds per sequence in the step, its API process
    ``frontend_latency`` seconds per request before the request reaches the engine (added
    to the scheduler's ``frontend_latency`` of every entry on the profile, when the entry
    is loaded), and ``reserved_memory`` bytes of each GPU's memory pool hold no KV cache
    (the CUDA context, activation workspace, CUDA graphs, communication buffers). The
    defaults, 0, are the roofline itself."""

    seq_overhead: float = attrs.field(default=0.0, validator=[_ge(0), _le(0.01)])
    frontend_latency: float = attrs.field(default=0.0, validator=[_ge(0), _le(10)])
    reserved_memory: float = attrs.field(default=0.0, validator=_ge(0))


@attrs.frozen(kw_only=True)
class HardwareEntry:
    #: The hardware profile's file name (``hardware_profiles/<profile>.toml``); None: the
    #: entry's own name. Lets one model have several entries on one GPU (tp variants,
    #: calibrated ones).
    profile: str | None = attrs.field(default=None, validator=_optional_name)
    tp: int = attrs.field(default=1, validator=_ge(1))
    #: Expert parallelism: the MoE layers' experts spread over ``ep`` GPUs, tokens sent to
    #: them and back by all-to-all (dispatch, combine) instead of an all-reduce.
    ep: int = attrs.field(default=1, validator=_ge(1))
    #: Data-parallel attention: a replica's ``tp`` GPUs form ``dp_attention`` ranks of
    #: ``tp / dp_attention`` GPUs, each with the attention and dense weights, its own
    #: scheduler and KV cache (a worker); the ranks step in lockstep and share the experts.
    dp_attention: int = attrs.field(default=1, validator=_ge(1))
    replicas: int = attrs.field(default=1, validator=_ge(1))
    router: str = attrs.field(default="round_robin", converter=_lower, validator=_one_of(ROUTERS))
    #: prefix_affinity: a replica is eligible while its load (running + waiting) is
    #: below ceil(ratio * (total load + 1) / replicas).
    affinity_load_ratio: float = attrs.field(default=1.25, validator=_ge(1))
    #: kv_aware: the weight of a replica's queued prefill tokens against the request's
    #: own uncached prompt tokens.
    kv_aware_queue_weight: float = attrs.field(default=1.0, validator=_ge(0))
    time_correction: TimeCorrection = attrs.field(factory=TimeCorrection)
    #: Replaces the profile's ``[efficiency]`` keys it sets, for this model only.
    efficiency: EfficiencyOverride | None = None
    #: Replaces the profile's ``[host]`` table, for this model only.
    host: Host | None = None
    #: A CSV of measured step times (docs/fidelity.md#measured-step-tables), relative to
    #: the config file; after loading, the resolved path.
    step_table: str | None = attrs.field(default=None, validator=_optional_nonempty)


# ---------------------------------------------------------------------------------------
# hardware profile


@attrs.frozen(kw_only=True)
class Link:
    bandwidth: float = attrs.field(validator=_gt(0))
    latency: float = attrs.field(validator=_ge(0))
    in_network_reduction: bool = False


@attrs.frozen(kw_only=True)
class Fabric:
    gpus_per_node: int = attrs.field(validator=_ge(1))
    scale_up: Link
    scale_out: Link | None = None


@attrs.frozen(kw_only=True)
class HardwareProfile:
    name: str
    flops_fp4: float | None = attrs.field(default=None, validator=_gt(0))
    flops_fp8: float | None = attrs.field(default=None, validator=_gt(0))
    flops_bf16: float | None = attrs.field(default=None, validator=_gt(0))
    flops_fp16: float | None = attrs.field(default=None, validator=_gt(0))
    memory_bandwidth: float = attrs.field(validator=_gt(0))
    memory_capacity: float = attrs.field(validator=_gt(0))
    fabric: Fabric | None = None
    efficiency: Efficiency = attrs.field(factory=Efficiency)
    host: Host = attrs.field(factory=Host)
    #: The profile this one was layered on (``base = "h100"``), for display; None for a
    #: datasheet profile.
    base: str | None = attrs.field(default=None, validator=_optional_name)

    def flops(self, precision: str) -> float | None:
        """FLOP/s of one GPU at ``precision`` (fp32 is fp16 / 2), or None if absent."""
        if precision == "fp32":
            return None if self.flops_fp16 is None else self.flops_fp16 / 2
        value: float | None = getattr(self, f"flops_{precision}")
        return value


# ---------------------------------------------------------------------------------------
# deployment: one model config x one of its hardware entries


@attrs.frozen(kw_only=True)
class Deployment:
    """Everything the engine needs, resolved and validated."""

    model: ModelArch
    scheduler: SchedulerConfig
    hardware: HardwareEntry
    profile: HardwareProfile
    hardware_name: str
    config_path: Path
    #: The entry's measured step table, read by the loader (None: the roofline alone).
    step_table: StepTable | None = None
    #: The model config's ``[speculative]`` table (None: no speculative decoding).
    speculative: SpeculativeConfig | None = None
    #: Its per-position acceptance rates, resolved by the loader (a CSV's are read there).
    acceptance_rates: tuple[float, ...] = ()

    @property
    def efficiency(self) -> Efficiency:
        """The profile's efficiency with the entry's ``efficiency`` keys over it."""
        override = self.hardware.efficiency
        return (
            self.profile.efficiency if override is None else override.over(self.profile.efficiency)
        )

    @property
    def host(self) -> Host:
        """The entry's ``host`` table if it has one, else the profile's."""
        return self.profile.host if self.hardware.host is None else self.hardware.host

    @property
    def workers(self) -> int:
        """Schedulers with their own KV cache: ``replicas * dp_attention``."""
        return self.hardware.replicas * self.hardware.dp_attention

    @property
    def attention_tp(self) -> int:
        """GPUs one sequence's attention is split over: ``tp / dp_attention``."""
        return self.hardware.tp // self.hardware.dp_attention

    @property
    def resident_weight_bytes(self) -> int:
        """Weight bytes one replica holds: the model's streams and the drafter's. With
        ``dp_attention`` ranks, each stream's dense part is held once per rank and its
        experts once (``floor`` per part)."""
        weights = list(self.model.weights)
        if self.speculative is not None:
            weights += self.speculative.drafter.weights
        dp = self.hardware.dp_attention
        if dp == 1:
            return sum(w.resident_bytes for w in weights)
        total = 0
        for w in weights:
            b = BYTES_PER_VALUE[w.precision]
            experts = w.expert_params
            total += math.floor(experts * b) + dp * math.floor((w.resident_params - experts) * b)
        return total

    @property
    def kv_bytes(self) -> float:
        """KV bytes of one worker (a replica, or one rank of it with ``dp_attention``):
        ``kv_cache_capacity`` when set, else the replica's memory pool
        (``floor(memory_capacity * tp * gpu_memory_utilization)``) less its resident
        weights and the host's ``reserved_memory`` per GPU, shared evenly by its ranks."""
        if self.scheduler.kv_cache_capacity > 0:
            return self.scheduler.kv_cache_capacity
        pool = math.floor(
            self.profile.memory_capacity * self.hardware.tp * self.scheduler.gpu_memory_utilization
        )
        dp = self.hardware.dp_attention
        free = pool - self.resident_weight_bytes
        reserved = self.host.reserved_memory
        if reserved:
            free -= math.floor(reserved * self.hardware.tp)
        return free if dp == 1 else free / dp

    def kv_layers(self) -> list[AttentionLayer | MLALayer]:
        """The KV layers of the model, then the drafter's."""
        layers = [layer for layer in self.model.layers if isinstance(layer, KV_LAYERS)]
        if self.speculative is not None:
            layers += [
                layer for layer in self.speculative.drafter.layers if isinstance(layer, KV_LAYERS)
            ]
        return layers

    def kv_bytes_per_position(self, layer: AttentionLayer | MLALayer) -> float:
        """KV bytes a worker holds per position of ``layer``: an MLA latent is replicated on
        every GPU of the attention group (``attention_tp``), a K/V head split among them."""
        if isinstance(layer, MLALayer):
            return layer.kv_bytes_per_position * self.attention_tp
        return layer.kv_bytes_per_position

    @property
    def block_bytes(self) -> float:
        return sum(
            layer.count * self.kv_bytes_per_position(layer) * self.scheduler.block_size
            for layer in self.kv_layers()
            if layer.window == 0
        )

    @property
    def total_blocks(self) -> int:
        return max(0, math.floor(self.kv_bytes / self.block_bytes))


@attrs.frozen(kw_only=True)
class ModelConfig:
    path: Path
    model: ModelArch
    scheduler: SchedulerConfig
    deployments: Mapping[str, Deployment]
    #: The model's static ``[fault]`` table (None: no faults).
    fault: FaultConfig | None = None
    #: The ``[speculative]`` table and its resolved acceptance rates (every deployment
    #: carries them too).
    speculative: SpeculativeConfig | None = None
    acceptance_rates: tuple[float, ...] = ()


# ---------------------------------------------------------------------------------------
# fault injection (the test harness: docs/test-harness.md)

#: The stream endings a fault can inject.
FAULT_MODES = (
    "cut_between_frames",
    "cut_mid_frame",
    "reset",
    "stall",
    "error_envelope_200",
    "error_400_in_sse",
    "no_done",
    "no_usage",
    "cancelled_499",
    "mid_reasoning",
    "mid_tool_call",
)
#: Bounds of ``after_chunks`` and ``delay_ms``: far above any useful test, far below a
#: stream that never ends.
MAX_FAULT_CHUNKS = 100_000
MAX_FAULT_DELAY_MS = 600_000


@attrs.frozen(kw_only=True)
class FaultConfig:
    """A fault directive: a model config's ``[fault]`` table, or one request's
    ``x-inference-lab-fault`` header (parsed by :mod:`inference_lab.serve.harness.directives`).

    ``after_chunks`` content frames (``delay_ms`` apart; with ``paced``, the engine's
    tokens as the model paces them) come before the ``mode``'s ending; ``utf8`` (only for
    ``cut_mid_frame``) puts the cut inside a multi-byte character. ``rate`` is the share
    of the model's streaming requests a ``[fault]`` table applies to (a header: 1).
    """

    mode: str = attrs.field(validator=_one_of(FAULT_MODES))
    after_chunks: int = attrs.field(default=3, validator=[_ge(0), _le(MAX_FAULT_CHUNKS)])
    delay_ms: int = attrs.field(default=10, validator=[_ge(0), _le(MAX_FAULT_DELAY_MS)])
    utf8: bool = False
    paced: bool = False
    rate: float = attrs.field(default=1.0, validator=[_ge(0), _le(1)])

    def __attrs_post_init__(self) -> None:
        if self.utf8 and self.mode != "cut_mid_frame":
            raise FieldError("utf8", f"applies to mode cut_mid_frame only, got mode {self.mode}")


# ---------------------------------------------------------------------------------------
# workload


def _floor_at_least_one(values: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
    out: np.ndarray[Any, np.dtype[np.int64]] = np.maximum(np.floor(values), 1).astype(np.int64)
    return out


@attrs.frozen(kw_only=True)
class FixedDist:
    type: str = "fixed"
    value: float = attrs.field(validator=_ge(1))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return _floor_at_least_one(np.full(size, self.value, dtype=np.float64))


@attrs.frozen(kw_only=True)
class UniformDist:
    type: str = "uniform"
    min: int = attrs.field(validator=_ge(1))
    max: int = attrs.field()

    @max.validator
    def _check_max(self, attr: attrs.Attribute[Any], value: int) -> None:
        if value < self.min:
            raise FieldError(attr.name, f"must be >= min ({self.min}), got {value}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return rng.integers(self.min, self.max, size=size, endpoint=True).astype(np.int64)


@attrs.frozen(kw_only=True)
class NormalDist:
    type: str = "normal"
    mean: float
    std_dev: float = attrs.field(validator=_ge(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return _floor_at_least_one(rng.normal(self.mean, self.std_dev, size=size))


@attrs.frozen(kw_only=True)
class LognormalDist:
    type: str = "lognormal"
    mean: float
    std_dev: float = attrs.field(validator=_ge(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return _floor_at_least_one(rng.lognormal(self.mean, self.std_dev, size=size))


LengthDist = FixedDist | UniformDist | NormalDist | LognormalDist
_DISTS: dict[str, type[Any]] = {
    "fixed": FixedDist,
    "uniform": UniformDist,
    "normal": NormalDist,
    "lognormal": LognormalDist,
}


# durations (seconds, not floored; >= 0)


@attrs.frozen(kw_only=True)
class FixedTime:
    type: str = "fixed"
    value: float = attrs.field(validator=_ge(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        return np.full(size, float(self.value), dtype=np.float64)


@attrs.frozen(kw_only=True)
class UniformTime:
    type: str = "uniform"
    min: float = attrs.field(validator=_ge(0))
    max: float = attrs.field()

    @max.validator
    def _check_max(self, attr: attrs.Attribute[Any], value: float) -> None:
        if value < self.min:
            raise FieldError(attr.name, f"must be >= min ({self.min}), got {value}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        return rng.uniform(self.min, self.max, size=size)


@attrs.frozen(kw_only=True)
class ExponentialTime:
    type: str = "exponential"
    mean: float = attrs.field(validator=_gt(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        return rng.exponential(self.mean, size=size)


@attrs.frozen(kw_only=True)
class LognormalTime:
    type: str = "lognormal"
    mean: float
    std_dev: float = attrs.field(validator=_ge(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        return rng.lognormal(self.mean, self.std_dev, size=size)


TimeDist = FixedTime | UniformTime | ExponentialTime | LognormalTime
_TIME_DISTS: dict[str, type[Any]] = {
    "fixed": FixedTime,
    "uniform": UniformTime,
    "exponential": ExponentialTime,
    "lognormal": LognormalTime,
}
_SCHEDULES: dict[str, type[Any]] = {
    "piecewise": PiecewiseRate,
    "sine": SineRate,
    "square": SquareRate,
}


@attrs.frozen(kw_only=True)
class SessionConfig:
    """A workload's ``[sessions]`` table: multi-turn conversations. The workload's
    ``input_len_dist`` is then the new user tokens of each turn and ``output_len_dist``
    each answer; its arrival pattern starts sessions (``closed_loop``: each user runs
    sessions back to back)."""

    num_sessions: int | None = attrs.field(default=None, validator=_ge(1))
    turns: LengthDist
    think_time: TimeDist = attrs.field(factory=lambda: FixedTime(value=0.0))
    system_prompt_tokens: int = attrs.field(default=0, validator=_ge(0))
    shared_system_prompt: bool = True


@attrs.frozen(kw_only=True)
class Workload:
    arrival_pattern: str = attrs.field(converter=_lower, validator=_one_of(ARRIVAL_PATTERNS))
    arrival_rate: float = attrs.field(default=1.0, validator=_gt(0))
    num_concurrent_users: int | None = attrs.field(default=None, validator=_ge(1))
    closed_loop_jitter_secs: float = attrs.field(default=0.0, validator=_ge(0))
    input_len_dist: LengthDist
    output_len_dist: LengthDist
    num_requests: int | None = attrs.field(default=None, validator=_ge(1))
    duration_secs: float | None = attrs.field(default=None, validator=_gt(0))
    seed: int = attrs.field(validator=_ge(0))
    sessions: SessionConfig | None = None
    rate_schedule: RateSchedule | None = None

    def __attrs_post_init__(self) -> None:
        if self.arrival_pattern == "closed_loop" and self.num_concurrent_users is None:
            raise FieldError(
                "num_concurrent_users", "is required when arrival_pattern = closed_loop"
            )
        sessions = self.sessions.num_sessions if self.sessions is not None else None
        if self.num_requests is None and self.duration_secs is None and sessions is None:
            if self.sessions is not None:
                raise FieldError(
                    "sessions", "set sessions.num_sessions, num_requests or duration_secs"
                )
            raise FieldError("num_requests", "set num_requests or duration_secs (or both)")
        if self.arrival_pattern == "batched" and self.num_requests is None and sessions is None:
            raise FieldError(
                "num_requests",
                "is required when arrival_pattern = batched (sessions.num_sessions with sessions)",
            )
        if self.rate_schedule is not None and self.arrival_pattern not in ("poisson", "uniform"):
            raise FieldError(
                "rate_schedule",
                f"applies to arrival_pattern poisson or uniform, not {self.arrival_pattern}",
            )


# ---------------------------------------------------------------------------------------
# the strict converter


def _tagged(tag: str, options: dict[str, type[Any]]) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _type: Any) -> Any:
        if not isinstance(value, Mapping):
            raise Invalid("a table", value)
        kind = value.get(tag)
        if kind not in options:
            raise FieldError(tag, f"must be one of {', '.join(options)}; got {kind!r}")
        return CONVERTER.structure(value, options[kind])

    return structure


CONVERTER = make_strict_converter(forbid_extra_keys=True, mapping_name="a table")
CONVERTER.register_structure_hook(
    Layer, _tagged("kind", {"attention": AttentionLayer, "mla": MLALayer, "linear": LinearLayer})
)
CONVERTER.register_structure_hook(LengthDist, _tagged("type", _DISTS))
CONVERTER.register_structure_hook(TimeDist, _tagged("type", _TIME_DISTS))
CONVERTER.register_structure_hook(RateSchedule, _tagged("type", _SCHEDULES))


def _error_lines(exc: BaseException, path: str) -> list[tuple[str, str]]:
    """Flatten a cattrs error tree into ``(key path, message)`` pairs, unknown keys first:
    a typo'd key (``max_num_seq``) is the cause, the required key it leaves missing
    (``max_num_seqs``) the consequence. An unknown key close to a key of its table is
    answered with that key, and the missing-key line it explains is dropped."""
    unknown: list[tuple[str, str]] = []
    other: list[tuple[str, str]] = []
    meant: set[str] = set()
    for where, leaf, _meta in error_leaves(exc, path):
        if isinstance(leaf, ForbiddenExtraKeysError):
            known = [a.name for a in attrs.fields(leaf.cl)] if attrs.has(leaf.cl) else []
            for key in sorted(leaf.extra_fields):
                close = difflib.get_close_matches(key, known, n=1)
                if close:
                    meant.add(join_path(where, close[0]))
                    unknown.append(
                        (join_path(where, key), f"unknown key (did you mean {close[0]}?)")
                    )
                else:
                    unknown.append((join_path(where, key), "unknown key"))
        elif isinstance(leaf, KeyError):
            other.append((where, "missing required key"))
        else:
            other.append((where, str(leaf) or type(leaf).__name__))
    explained = [(where, message) for where, message in other if where not in meant]
    return unknown + explained


def _structure(raw: Any, cls: type[T], file: Path, path: str) -> T:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{file}: {path or '(top level)'}: must be a table, got {raw!r}")
    try:
        return CONVERTER.structure(raw, cls)
    except Exception as exc:  # noqa: BLE001 - every structuring failure becomes a ConfigError
        lines = _error_lines(exc, path)
        key, message = lines[0] if lines else (path, str(exc))
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise ConfigError(f"{file}: {key or '(top level)'}: {message}{more}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None


def _resolve_tokenizer(file: Path, written: str) -> Path:
    """``[model].tokenizer`` resolved against the config file's directory; it must exist
    (the tokenizer itself is read by :func:`inference_lab.api.tokenizer.load_tokenizer`)."""
    path = Path(written).expanduser()
    if not path.is_absolute():
        path = file.parent / path
    if not path.exists():
        raise ConfigError(f"{file}: model.tokenizer: no such file or directory {path}")
    return path


def load_hardware_profile(path: Path) -> HardwareProfile:
    """Read one ``hardware_profiles/<name>.toml``; raises ConfigError.

    A profile with ``base = "<name>"`` is layered on ``<name>.toml`` of the same
    directory: its own top-level keys replace the base's (a calibrated profile names its
    base and adds only its ``[efficiency]``). A base cannot have a base itself."""
    raw = _read_toml(path)
    base = raw.get("base")
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: base: must be a profile name, got {base!r}")
        base_path = path.parent / f"{base}.toml"
        if not base_path.is_file():
            raise ConfigError(f"{path}: base: no hardware profile {base_path}")
        base_raw = _read_toml(base_path)
        if "base" in base_raw:
            raise ConfigError(
                f"{path}: base: {base_path} has a base itself; a base must be a datasheet profile"
            )
        raw = {**base_raw, **raw}
    return _structure(raw, HardwareProfile, path, "")


def _resolve(file: Path, written: str) -> Path:
    """A path written in ``file``, relative to its directory."""
    path = Path(written).expanduser()
    return path if path.is_absolute() else file.parent / path


def _read_text(path: Path, where: str) -> str:
    """The UTF-8 text of a file a config names; ConfigError starting with ``where`` (the
    config file and key) when it is missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc}") from None


def load_acceptance_rounds(file: Path, path: Path, gamma: int, where: str) -> tuple[float, ...]:
    """A CSV of measured speculative-decoding rounds: one accepted draft count per line
    (0..``gamma``; a header line whose first cell is not a number is skipped; further
    cells are ignored). Returns the per-position acceptance rates: the share of rounds
    that accepted at least ``j`` tokens, ``j = 1..gamma``. ConfigError names the file and
    line."""
    text = _read_text(path, f"{file}: {where}")
    counts = [0] * (gamma + 1)
    rounds = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cell = line.split(",")[0].strip()
        try:
            value = int(cell)
        except ValueError:
            if number == 1 and not rounds:
                continue  # a header
            raise ConfigError(
                f"{path}:{number}: must be an accepted draft count (an integer), got {cell!r}"
            ) from None
        if not 0 <= value <= gamma:
            raise ConfigError(
                f"{path}:{number}: accepted count must be in 0..{gamma} "
                f"(num_speculative_tokens), got {value}"
            )
        counts[value] += 1
        rounds += 1
    if not rounds:
        raise ConfigError(f"{path}: no acceptance rounds")
    rates = []
    at_least = rounds
    for j in range(1, gamma + 1):
        at_least -= counts[j - 1]
        rates.append(at_least / rounds)
    return tuple(rates)


def load_step_table(file: Path, written: str, where: str) -> StepTable:
    """An entry's ``step_table`` CSV, resolved against the config file's directory and
    parsed (:func:`inference_lab.core.step_table.parse_step_table`); ConfigError names the
    key, or the CSV file and line."""
    path = Path(written).expanduser()
    if not path.is_absolute():
        path = file.parent / path
    text = _read_text(path, f"{file}: {where}")
    return parse_step_table(text, str(path))


def default_profiles_dir(config_path: Path) -> Path:
    """Where hardware profiles are looked up for ``config_path``.

    ``$INFERENCE_LAB_HARDWARE_PROFILES`` if set; else the first of
    ``<config dir>/../hardware_profiles`` and ``<config dir>/hardware_profiles`` that
    exists; else the shipped profiles (:func:`inference_lab.resources.shipped_dir`).
    """
    env = os.environ.get("INFERENCE_LAB_HARDWARE_PROFILES")
    if env:
        return Path(env)
    here = config_path.resolve().parent
    for candidate in (here.parent / "hardware_profiles", here / "hardware_profiles"):
        if candidate.is_dir():
            return candidate
    return shipped_dir("hardware_profiles")


def _validate_deployment(dep: Deployment, file: Path, profile_path: Path) -> None:
    where = f"{file}: hardware.{dep.hardware_name}"
    hw, profile, model = dep.hardware, dep.profile, dep.model
    if hw.tp % hw.ep != 0:
        raise ConfigError(f"{where}.ep: must divide tp (tp = {hw.tp}, ep = {hw.ep})")
    if hw.tp % hw.dp_attention != 0:
        raise ConfigError(
            f"{where}.dp_attention: must divide tp (tp = {hw.tp}, dp_attention = {hw.dp_attention})"
        )
    if hw.dp_attention > 1 and hw.ep == 1:
        raise ConfigError(
            f"{where}.dp_attention: data-parallel attention needs expert parallelism "
            "(ep > 1): its ranks exchange tokens with the experts by all-to-all"
        )
    if hw.dp_attention > 1 and hw.step_table is not None:
        raise ConfigError(
            f"{where}.step_table: a measured step table cannot price data-parallel attention"
        )
    if hw.tp > 1:
        if profile.fabric is None:
            raise ConfigError(f"{where}.tp: tp = {hw.tp} needs a [fabric] table in {profile_path}")
        if hw.tp > profile.fabric.gpus_per_node and profile.fabric.scale_out is None:
            raise ConfigError(
                f"{where}.tp: tp = {hw.tp} spans more than gpus_per_node = "
                f"{profile.fabric.gpus_per_node} and needs fabric.scale_out in {profile_path}"
            )
    used = [(f"model.weights[{i}].precision", w.precision) for i, w in enumerate(model.weights)]
    used.append(("model.attention_precision", model.attention_precision))
    for key, precision in used:
        if profile.flops(precision) is None:
            rate = "flops_fp16" if precision == "fp32" else f"flops_{precision}"
            raise ConfigError(
                f"{file}: {key}: precision {precision} has no FLOP rate ({rate}) in "
                f"hardware profile {profile_path} used by hardware.{dep.hardware_name}"
            )
    sched = dep.scheduler
    if sched.kv_cache_capacity == 0:
        pool = math.floor(profile.memory_capacity * hw.tp * sched.gpu_memory_utilization)
        weights = dep.resident_weight_bytes
        if weights >= pool:
            raise ConfigError(
                f"{where}: resident weights ({weights:,} B) do not fit in memory_capacity x tp x "
                f"gpu_memory_utilization ({pool:,} B); raise tp or set kv_cache_capacity"
            )
    if dep.total_blocks < 1:
        raise ConfigError(
            f"{where}: the KV cache ({dep.kv_bytes:,.0f} B) holds no block of "
            f"{dep.block_bytes:,.0f} B"
        )


def load_model_config(
    path: str | os.PathLike[str], profiles_dir: Path | None = None
) -> ModelConfig:
    """Read and validate a model config and every one of its hardware entries.

    Raises ConfigError (one line: file and key path) on any problem; returns only a
    config in which every deployment is usable.
    """
    file = Path(path)
    raw = _read_toml(file)
    for key in raw:
        if key not in ("model", "scheduler", "hardware", "fault", "speculative"):
            raise ConfigError(
                f"{file}: {key}: unknown key (a model config holds the tables [model], "
                "[scheduler], [hardware.<name>] and optionally [fault] and [speculative])"
            )
    fault = _structure(raw["fault"], FaultConfig, file, "fault") if "fault" in raw else None
    speculative = None
    rates: tuple[float, ...] = ()
    if "speculative" in raw:
        speculative = _structure(raw["speculative"], SpeculativeConfig, file, "speculative")
        if speculative.acceptance_file is not None:
            path = _resolve(file, speculative.acceptance_file)
            rates = load_acceptance_rounds(
                file, path, speculative.num_speculative_tokens, "speculative.acceptance_file"
            )
            speculative = attrs.evolve(speculative, acceptance_file=str(path))
        else:
            rates = speculative.rates()
    for key in ("model", "scheduler", "hardware"):
        if key not in raw:
            raise ConfigError(f"{file}: {key}: missing required table [{key}]")
    model = _structure(raw["model"], ModelArch, file, "model")
    if model.tokenizer is not None:
        model = attrs.evolve(model, tokenizer=str(_resolve_tokenizer(file, model.tokenizer)))
    sched_raw = raw["scheduler"]
    scheduler = _structure(sched_raw, SchedulerConfig, file, "scheduler")
    hw_tables = raw["hardware"]
    if not isinstance(hw_tables, Mapping) or not hw_tables:
        raise ConfigError(f"{file}: hardware: needs at least one [hardware.<name>] table")
    profiles = profiles_dir if profiles_dir is not None else default_profiles_dir(file)
    deployments: dict[str, Deployment] = {}
    for name, table in hw_tables.items():
        prefix = f"hardware.{name}"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{file}: {prefix}: must be a table, got {table!r}")
        entry_raw = dict(table)
        override = entry_raw.pop("scheduler", {})
        if not isinstance(override, Mapping):
            raise ConfigError(f"{file}: {prefix}.scheduler: must be a table, got {override!r}")
        entry = _structure(entry_raw, HardwareEntry, file, prefix)
        merged = _structure({**sched_raw, **override}, SchedulerConfig, file, f"{prefix}.scheduler")
        profile_name = entry.profile if entry.profile is not None else name
        profile_path = profiles / f"{profile_name}.toml"
        if not profile_path.is_file():
            key = f"{prefix}.profile" if entry.profile is not None else prefix
            raise ConfigError(f"{file}: {key}: no hardware profile {profile_path}")
        profile = load_hardware_profile(profile_path)
        host = profile.host if entry.host is None else entry.host
        if host.frontend_latency:
            latency = merged.frontend_latency + host.frontend_latency
            merged = attrs.evolve(merged, frontend_latency=latency)
        table = None
        if entry.step_table is not None:
            table = load_step_table(file, entry.step_table, f"{prefix}.step_table")
            entry = attrs.evolve(entry, step_table=table.source)
        dep = Deployment(
            model=model,
            scheduler=merged,
            hardware=entry,
            profile=profile,
            hardware_name=name,
            config_path=file,
            step_table=table,
            speculative=speculative,
            acceptance_rates=rates,
        )
        _validate_deployment(dep, file, profile_path)
        deployments[name] = dep
    return ModelConfig(
        path=file,
        model=model,
        scheduler=scheduler,
        deployments=deployments,
        fault=fault,
        speculative=speculative,
        acceptance_rates=rates,
    )


def select_deployment(config: ModelConfig, hardware: str | None) -> Deployment:
    """The entry named ``hardware``; with None, the only entry (ConfigError if several)."""
    names = list(config.deployments)
    if hardware is None:
        if len(names) != 1:
            raise ConfigError(
                f"{config.path}: hardware: several entries ({', '.join(names)}); "
                "choose one with --hardware"
            )
        return config.deployments[names[0]]
    if hardware not in config.deployments:
        raise ConfigError(
            f"{config.path}: hardware.{hardware}: no such entry (available: {', '.join(names)})"
        )
    return config.deployments[hardware]


def override_scheduler(
    dep: Deployment, *, max_num_seqs: int | None = None, max_waiting: int | None = None
) -> Deployment:
    """``dep`` with ``max_num_seqs`` / ``max_waiting`` replaced where not None: the
    ``--max-num-seqs`` / ``--max-waiting`` flags of ``sim`` and ``serve`` (the caller has
    checked the bounds, >= 1 and >= 0)."""
    sched = dep.scheduler
    if max_num_seqs is not None:
        sched = attrs.evolve(sched, max_num_seqs=max_num_seqs)
    if max_waiting is not None:
        sched = attrs.evolve(sched, max_waiting=max_waiting)
    return dep if sched is dep.scheduler else attrs.evolve(dep, scheduler=sched)


def load_deployment(
    config_path: str | os.PathLike[str],
    hardware: str | None = None,
    profiles_dir: Path | None = None,
) -> Deployment:
    """Load ``config_path`` and return its ``[hardware.<hardware>]`` deployment."""
    return select_deployment(load_model_config(config_path, profiles_dir), hardware)


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Read and validate a workload TOML; raises ConfigError. A piecewise schedule's
    ``points_file`` is read (relative to the workload file) into its points."""
    file = Path(path)
    workload = _structure(_read_toml(file), Workload, file, "")
    schedule = workload.rate_schedule
    if isinstance(schedule, PiecewiseRate) and schedule.points_file is not None:
        if schedule.points:
            raise ConfigError(
                f"{file}: rate_schedule.points_file: give points or points_file, not both"
            )
        points_path = Path(schedule.points_file).expanduser()
        if not points_path.is_absolute():
            points_path = file.parent / points_path
        points = _read_rate_points(points_path, file)
        schedule = attrs.evolve(schedule, points=points, points_file=str(points_path))
        workload = attrs.evolve(workload, rate_schedule=schedule)
    return workload


def _read_rate_points(path: Path, workload: Path) -> tuple[tuple[float, float], ...]:
    """A rate schedule's points from a CSV of ``time_s,rate`` rows (a header line whose
    first cell is not a number is skipped). ConfigError names the file and line."""
    where = f"{workload}: rate_schedule.points_file"
    text = _read_text(path, where)
    points: list[tuple[float, float]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        cells = [c.strip() for c in line.split(",")]
        if not line.strip():
            continue
        try:
            values = [float(c) for c in cells]
        except ValueError:
            if number == 1 and not points:
                continue  # a header
            raise ConfigError(
                f"{path}:{number}: must be two numbers time_s,rate, got {line!r}"
            ) from None
        if len(values) != 2 or not all(math.isfinite(v) for v in values):
            raise ConfigError(f"{path}:{number}: must be two numbers time_s,rate, got {line!r}")
        points.append((values[0], values[1]))
    try:
        check_points(tuple(points))
    except FieldError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return tuple(points)


# ---------------------------------------------------------------------------------------
# deployment variants (capacity planning: ``inference_lab.plan``)


def base_deployment(
    config: ModelConfig, hardware: str, profiles_dir: Path | None = None
) -> Deployment:
    """``config``'s ``[hardware.<hardware>]`` deployment; when it has no such entry, one
    built from the hardware profile ``<hardware>.toml`` with a default entry (tp 1, one
    replica) and the config's ``[scheduler]``. The second is not validated here (a plan
    changes its tp before :func:`vary_deployment` checks it); ConfigError when the profile
    does not exist."""
    if hardware in config.deployments:
        return config.deployments[hardware]
    profiles = profiles_dir if profiles_dir is not None else default_profiles_dir(config.path)
    profile_path = profiles / f"{hardware}.toml"
    if not profile_path.is_file():
        raise ConfigError(
            f"{config.path}: hardware.{hardware}: no such entry and no hardware profile "
            f"{profile_path}"
        )
    return Deployment(
        model=config.model,
        scheduler=config.scheduler,
        hardware=HardwareEntry(),
        profile=load_hardware_profile(profile_path),
        hardware_name=hardware,
        config_path=config.path,
        speculative=config.speculative,
        acceptance_rates=config.acceptance_rates,
    )


def vary_deployment(
    dep: Deployment,
    *,
    tp: int | None = None,
    replicas: int | None = None,
    scheduler: Mapping[str, Any] | None = None,
    where: str = "",
) -> Deployment:
    """``dep`` with another tp, replica count or scheduler settings, checked exactly as a
    config file's entry is (parallelism, precisions, fit, KV blocks).

    ``scheduler`` values go through the strict converter on top of ``dep``'s settings;
    ``where`` names their source in an error (``plan.toml: scheduler``). Raises ConfigError,
    one line: why this variant cannot run (the weights do not fit, tp needs a fabric, ...).
    """
    hardware = dep.hardware
    if tp is not None or replicas is not None:
        hardware = attrs.evolve(
            hardware,
            tp=hardware.tp if tp is None else tp,
            replicas=hardware.replicas if replicas is None else replicas,
        )
    sched = dep.scheduler
    if scheduler:
        merged = {**attrs.asdict(sched), **scheduler}
        sched = _structure(merged, SchedulerConfig, Path(where or dep.config_path), "scheduler")
    out = attrs.evolve(dep, hardware=hardware, scheduler=sched)
    profiles = default_profiles_dir(dep.config_path)
    _validate_deployment(out, dep.config_path, profiles / f"{dep.hardware_name}.toml")
    return out


def structure_table(raw: Any, cls: type[T], file: Path, path: str = "") -> T:
    """``raw`` (a TOML table) as ``cls`` through the strict converter; ConfigError with
    ``file: key.path: message`` (Rules 1-2). For files whose loader lives elsewhere (the
    planner's spec)."""
    return _structure(raw, cls, file, path)


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's top-level table; ConfigError naming the file when it is missing,
    unreadable or invalid."""
    return _read_toml(path)
