"""Configuration: model configs, hardware profiles, workloads.

The package, by concern:

- :mod:`~inference_lab.core.config.checks`: the field checks (attrs validators);
- :mod:`~inference_lab.core.config.model`: layers, weight streams, ``ModelArch``, reasoning;
- :mod:`~inference_lab.core.config.speculative`: the drafter, ``SpeculativeConfig``,
  acceptance rates;
- :mod:`~inference_lab.core.config.lora`: ``[lora]``, adapters and their sizes;
- :mod:`~inference_lab.core.config.scheduler`: ``SchedulerConfig``;
- :mod:`~inference_lab.core.config.hardware`: profiles, entries, efficiency, links, fabric;
- :mod:`~inference_lab.core.config.deployment`: ``Deployment``, ``ModelConfig``,
  ``Disaggregation``;
- :mod:`~inference_lab.core.config.engine_memory`: the memory vLLM keeps out of its KV
  cache (weights as loaded, the profile run's peak);
- :mod:`~inference_lab.core.config.disaggregation`: ``[disaggregation]``, the KV link's
  price;
- :mod:`~inference_lab.core.config.fault`: the test harness's ``[fault]`` table;
- :mod:`~inference_lab.core.config.workload`: length and time distributions,
  ``SessionConfig``, ``Workload``;
- :mod:`~inference_lab.core.config.workload_files`: reading a workload file;
- :mod:`~inference_lab.core.config.convert`: reading TOML, the strict cattrs converter;
- :mod:`~inference_lab.core.config.loading`: the loaders and deployment variants.

This module re-exports the names callers outside the package use
(``from inference_lab.core.config import load_deployment``); the package's own modules
import from each other directly.

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

from inference_lab.core.config.convert import (
    CONVERTER,
    read_text,
    read_toml,
    structure_table,
)
from inference_lab.core.config.deployment import (
    Deployment,
    Disaggregation,
    ModelConfig,
    with_lora,
)
from inference_lab.core.config.disaggregation import (
    DECODE_ROUTERS,
    LINKS,
    DisaggregationConfig,
    PoolConfig,
    transfer_seconds,
)
from inference_lab.core.config.fault import (
    FAULT_MODES,
    MAX_FAULT_CHUNKS,
    MAX_FAULT_DELAY_MS,
    FaultConfig,
)
from inference_lab.core.config.hardware import (
    ROUTERS,
    Efficiency,
    EfficiencyOverride,
    Fabric,
    HardwareEntry,
    HardwareProfile,
    HostLink,
    Link,
    Overheads,
    TimeCorrection,
)
from inference_lab.core.config.loading import (
    base_deployment,
    default_profiles_dir,
    disaggregate,
    load_acceptance_rounds,
    load_deployment,
    load_hardware_profile,
    load_model_config,
    load_step_table,
    override_scheduler,
    select_deployment,
    split_pd,
    vary_deployment,
)
from inference_lab.core.config.lora import (
    LORA_RANKS,
    LoraAdapter,
    LoraConfig,
    adapter_widths,
)
from inference_lab.core.config.model import (
    BYTES_PER_VALUE,
    EFFORTS,
    KV_LAYERS,
    PRECISIONS,
    AttentionLayer,
    Layer,
    LinearLayer,
    MLALayer,
    ModelArch,
    ReasoningConfig,
    Routing,
    WeightStream,
)
from inference_lab.core.config.scheduler import (
    POLICIES,
    SchedulerConfig,
)
from inference_lab.core.config.speculative import (
    DRAFTER_KINDS,
    MAX_SPECULATIVE_TOKENS,
    DrafterConfig,
    DraftWeightStream,
    SpeculativeConfig,
    check_acceptance_rates,
)
from inference_lab.core.config.workload import (
    ARRIVAL_PATTERNS,
    AdapterMix,
    ExponentialTime,
    FixedDist,
    FixedTime,
    LengthDist,
    LognormalDist,
    LognormalTime,
    NormalDist,
    SessionConfig,
    TimeDist,
    UniformDist,
    UniformTime,
    Workload,
)
from inference_lab.core.config.workload_files import load_workload

__all__ = [
    "ARRIVAL_PATTERNS",
    "AttentionLayer",
    "BYTES_PER_VALUE",
    "CONVERTER",
    "DRAFTER_KINDS",
    "DECODE_ROUTERS",
    "Deployment",
    "Disaggregation",
    "DisaggregationConfig",
    "DraftWeightStream",
    "DrafterConfig",
    "EFFORTS",
    "Efficiency",
    "EfficiencyOverride",
    "Overheads",
    "ExponentialTime",
    "FAULT_MODES",
    "Fabric",
    "FaultConfig",
    "FixedDist",
    "FixedTime",
    "HardwareEntry",
    "HardwareProfile",
    "HostLink",
    "KV_LAYERS",
    "LINKS",
    "Layer",
    "LengthDist",
    "LinearLayer",
    "Link",
    "LognormalDist",
    "LognormalTime",
    "MAX_FAULT_CHUNKS",
    "MAX_FAULT_DELAY_MS",
    "MAX_SPECULATIVE_TOKENS",
    "MLALayer",
    "ModelArch",
    "ModelConfig",
    "NormalDist",
    "POLICIES",
    "PRECISIONS",
    "PoolConfig",
    "ROUTERS",
    "ReasoningConfig",
    "Routing",
    "SchedulerConfig",
    "SessionConfig",
    "SpeculativeConfig",
    "LORA_RANKS",
    "LoraAdapter",
    "LoraConfig",
    "adapter_widths",
    "with_lora",
    "TimeCorrection",
    "TimeDist",
    "UniformDist",
    "UniformTime",
    "WeightStream",
    "Workload",
    "AdapterMix",
    "base_deployment",
    "check_acceptance_rates",
    "default_profiles_dir",
    "disaggregate",
    "load_acceptance_rounds",
    "load_deployment",
    "load_hardware_profile",
    "load_model_config",
    "load_step_table",
    "load_workload",
    "override_scheduler",
    "read_text",
    "read_toml",
    "select_deployment",
    "split_pd",
    "structure_table",
    "transfer_seconds",
    "vary_deployment",
]
