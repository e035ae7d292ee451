"""The checks of a resolved hardware entry (a :class:`Deployment`): what no single table's
validators can see, because it needs the model, the entry and its profile together.

Rule 1: parallelism agrees: ``ep`` and ``dp_attention`` divide ``tp``; data-parallel
        attention needs expert parallelism and no step table; ``tp > 1`` needs the
        profile's ``[fabric]``, and a ``tp`` wider than a node its ``scale_out``.
Rule 2: every precision the model uses has a FLOP rate in the profile.
Rule 3: the resident weights fit in memory x tp x ``gpu_memory_utilization`` (unless
        ``kv_cache_capacity`` is given), and the KV cache holds at least one block.
Rule 4: a host KV tier needs the profile's ``[host]`` link and fits in its memory x tp; a
        disk tier sits behind a host tier.

Every failure is one :class:`ConfigError` line naming the file and the key path.
"""

from __future__ import annotations

import math
from pathlib import Path

from inference_lab.core.config.deployment import Deployment
from inference_lab.errors import ConfigError

__all__ = ["check_deployment"]


def check_deployment(dep: Deployment, file: Path, profile_path: Path) -> None:
    """Rules 1-4 for ``dep``, the entry of ``file`` resolved against the profile at
    ``profile_path``; ConfigError (one line) for the first that fails. The loaders call
    it for every entry and every variant."""
    where = f"{file}: hardware.{dep.hardware_name}"
    hw, profile, model = dep.hardware, dep.profile, dep.model
    _validate_parallelism(dep, where, profile_path)
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
    if dep.overheads.profile_run and model.vocab_size == 0:
        raise ConfigError(f"{where}: [overheads] profile_run needs [model] vocab_size")
    if sched.kv_cache_capacity == 0:
        pool = math.floor(profile.memory_capacity * hw.tp * sched.gpu_memory_utilization)
        weights = dep.resident_weight_bytes
        if weights >= pool:
            raise ConfigError(
                f"{where}: resident weights ({weights:,} B) do not fit in memory_capacity x tp x "
                f"gpu_memory_utilization ({pool:,} B); raise tp or set kv_cache_capacity"
            )
    _validate_tiers(dep, where, profile_path)
    if dep.total_blocks < 1:
        raise ConfigError(
            f"{where}: the KV cache ({dep.kv_bytes:,.0f} B) holds no block of "
            f"{dep.block_bytes:,.0f} B"
        )


def _validate_parallelism(dep: Deployment, where: str, profile_path: Path) -> None:
    """The entry's tp, ep and dp_attention agree with each other, with a step table and
    with the profile's fabric."""
    hw, profile = dep.hardware, dep.profile
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


def _validate_tiers(dep: Deployment, where: str, profile_path: Path) -> None:
    """The KV tiers behind HBM (docs/kv-tiers.md): a host tier needs the profile's
    ``[host]`` link and fits in its ``memory`` x tp (the host DRAM of the replica's GPUs);
    a disk tier sits behind a host tier."""
    sched = dep.scheduler
    size = sched.kv_offloading_size
    if sched.kv_offloading_disk_size and not size:
        raise ConfigError(
            f"{where}.scheduler.kv_offloading_disk_size: a disk tier sits behind a host "
            "tier: set kv_offloading_size too"
        )
    if not size:
        return
    host = dep.profile.host
    if host is None:
        raise ConfigError(
            f"{where}.scheduler.kv_offloading_size: the profile {profile_path} has no [host] "
            "table (the link to host memory the tier is read over)"
        )
    bound = host.memory * dep.hardware.tp
    if size * 2**30 > bound:
        raise ConfigError(
            f"{where}.scheduler.kv_offloading_size: {size:g} GiB is more than the host "
            f"memory of the replica's {dep.hardware.tp} GPU(s) ({bound / 2**30:,.0f} GiB: "
            f"[host] memory x tp in {profile_path})"
        )
