"""A deployment (one model config x one of its hardware entries) and a model config.

Rule 1: a :class:`Deployment` the loader returns is usable as it is (the loader checked
        it whole: parallelism, precisions, fit, KV blocks); what it derives (workers,
        resident weights, KV bytes and blocks) is pure arithmetic on its fields.
Rule 2: a worker is a replica, or one attention rank of it with ``dp_attention``: its KV
        bytes are the replica's pool less its resident weights, shared evenly by its
        ranks (``docs/configuration.md#kv-capacity``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import attrs

from inference_lab.core.config import engine_memory
from inference_lab.core.config.disaggregation import DisaggregationConfig, transfer_seconds
from inference_lab.core.config.fault import FaultConfig
from inference_lab.core.config.hardware import (
    Efficiency,
    HardwareEntry,
    HardwareProfile,
    Link,
    Overheads,
)
from inference_lab.core.config.lora import LoraConfig
from inference_lab.core.config.model import (
    BYTES_PER_VALUE,
    KV_LAYERS,
    AttentionLayer,
    MLALayer,
    ModelArch,
    WeightStream,
)
from inference_lab.core.config.scheduler import SchedulerConfig
from inference_lab.core.config.speculative import SpeculativeConfig
from inference_lab.core.step_table import StepTable
from inference_lab.errors import ConfigError

__all__ = ["Deployment", "Disaggregation", "ModelConfig", "with_lora"]


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
    #: Its split into a prefill and a decode pool (None: aggregated; docs/disaggregation.md)
    disaggregation: Disaggregation | None = None
    #: LoRA adapters (``[lora]`` or ``serve --enable-lora``; None: none; docs/lora.md)
    lora: LoraConfig | None = None

    @property
    def efficiency(self) -> Efficiency:
        """The profile's efficiency with the entry's ``efficiency`` keys over it."""
        override = self.hardware.efficiency
        return (
            self.profile.efficiency if override is None else override.over(self.profile.efficiency)
        )

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
        weights = self._weight_streams()
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
    def overheads(self) -> Overheads:
        """The entry's ``overheads`` table if it has one, else the profile's."""
        return (
            self.profile.overheads if self.hardware.overheads is None else self.hardware.overheads
        )

    @property
    def kv_bytes(self) -> float:
        """KV bytes of one worker (a replica, or one rank of it with ``dp_attention``):
        ``kv_cache_capacity`` when set, else the replica's memory pool
        (``floor(memory_capacity * tp * gpu_memory_utilization)``) less its resident
        weights, the ``reserved_memory`` per GPU and what the profile's vLLM memory keys
        hold back (:mod:`~inference_lab.core.config.engine_memory`), shared evenly by
        its ranks."""
        if self.scheduler.kv_cache_capacity > 0:
            return self.scheduler.kv_cache_capacity
        pool = math.floor(
            self.profile.memory_capacity * self.hardware.tp * self.scheduler.gpu_memory_utilization
        )
        dp = self.hardware.dp_attention
        free = pool - self.resident_weight_bytes
        reserved = self.overheads.reserved_memory
        if reserved:
            free -= math.floor(reserved * self.hardware.tp)
        if engine_memory.active(self.overheads):  # the KV capacity as vLLM sizes it
            free -= engine_memory.held_back_bytes(
                self.model, self._weight_streams(), self.scheduler, self.overheads, self.hardware.tp
            )
        return free if dp == 1 else free / dp

    def _weight_streams(self) -> list[WeightStream]:
        """The model's weight streams, then the drafter's."""
        weights = list(self.model.weights)
        if self.speculative is not None:
            weights += self.speculative.drafter.weights
        return weights

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

    def kv_bytes_of(self, positions: int) -> float:
        """KV bytes one worker holds for a sequence of ``positions`` positions: every KV
        layer's bytes per position, a windowed layer's for at most its window (what a KV
        transfer moves)."""
        total = 0.0
        for layer in self.kv_layers():
            held = positions if layer.window <= 0 else min(positions, layer.window)
            total += layer.count * self.kv_bytes_per_position(layer) * held
        return total

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
class Disaggregation:
    """A deployment split into a prefill and a decode pool, resolved (the config's
    ``[disaggregation]``: :mod:`inference_lab.core.config.disaggregation`): each pool's
    deployment (checked as a config entry is), its router, the link the KV cache crosses
    and over how many GPU links at once (``streams``), whether the transfer overlaps the
    prefill, and the proxy's hop between the two requests."""

    prefill: Deployment
    decode: Deployment
    prefill_router: str
    decode_router: str
    link: Link
    #: ``scale_up`` (NVLink within a node) or ``scale_out`` (the NICs)
    link_name: str
    streams: int
    overlap: bool
    handoff_latency: float

    def transfer_seconds(self, kv_bytes: float, overlapped: float = 0.0) -> float:
        """Seconds a transfer of ``kv_bytes`` shows (``disaggregation.transfer_seconds``);
        ``overlapped``: the seconds of prefill it could hide behind, with ``overlap``."""
        return transfer_seconds(
            self.link,
            self.streams,
            kv_bytes,
            overlap=self.overlap,
            layers=self.prefill.model.num_layers,
            overlapped=overlapped,
        )

    @property
    def gpus(self) -> int:
        """GPUs of both pools."""
        p, d = self.prefill.hardware, self.decode.hardware
        return p.tp * p.replicas + d.tp * d.replicas


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
    #: The ``[lora]`` table (every deployment carries it; None: no adapters).
    lora: LoraConfig | None = None
    #: The ``[disaggregation]`` table as written (resolved when an entry is selected).
    disaggregation: DisaggregationConfig | None = None


def with_lora(dep: Deployment, lora: LoraConfig | None, where: str) -> Deployment:
    """``dep`` serving the adapters of ``lora`` (None: ``dep`` unchanged). Raises
    ConfigError, one line naming ``where``, for what LoRA is not modelled with:
    data-parallel attention ranks, a disaggregated deployment, speculative decoding, KV
    tiers; or a profile without a ``[host]`` link.
    Called by the config loader for ``[lora]`` and by ``serve --enable-lora``."""
    if lora is None:
        return dep
    if dep.hardware.dp_attention > 1:
        raise ConfigError(f"{where}: not modelled with data-parallel attention ranks")
    if dep.disaggregation is not None:
        raise ConfigError(f"{where}: not modelled with [disaggregation]")
    if dep.speculative is not None:
        raise ConfigError(f"{where}: not modelled with [speculative]")
    if dep.scheduler.kv_offloading_size > 0:
        raise ConfigError(f"{where}: not modelled with KV tiers (kv_offloading_size)")
    if dep.profile.host is None:
        raise ConfigError(
            f"{where}: the hardware profile {dep.profile.name!r} has no [host] link to "
            "load adapters over (docs/kv-tiers.md)"
        )
    return attrs.evolve(dep, lora=lora)
