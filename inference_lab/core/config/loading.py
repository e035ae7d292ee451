"""The loaders: model configs (with their hardware entries and profiles), workloads,
and the deployment variants of a capacity plan.

Rule 1: a model config is valid as a whole or not at all: every ``[hardware.*]`` entry is
        resolved against its profile and checked (parallelism, precisions, fit, KV blocks)
        at load time, never later at run time.
Rule 2: every file a config points at (a profile's ``base``, an entry's ``step_table``, a
        speculative ``acceptance_file``, a schedule's ``points_file``) is read here, by
        the loader, so the engine and the roofline never do I/O; the defaults
        (efficiency 1.0, no overhead, no step table) price every step exactly as the
        datasheet roofline does.
Rule 3: every error is a :class:`ConfigError` of one line naming the file and the key
        path (or the data file and line).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from inference_lab.core.config.convert import read_text, read_toml, structure_table
from inference_lab.core.config.deployment import Deployment, Disaggregation, ModelConfig, with_lora
from inference_lab.core.config.disaggregation import DECODE_ROUTERS, DisaggregationConfig
from inference_lab.core.config.fault import FaultConfig
from inference_lab.core.config.hardware import ROUTERS, HardwareEntry, HardwareProfile
from inference_lab.core.config.lora import LoraConfig
from inference_lab.core.config.model import ModelArch
from inference_lab.core.config.scheduler import SchedulerConfig
from inference_lab.core.config.speculative import SpeculativeConfig
from inference_lab.core.step_table import StepTable, parse_step_table
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir

__all__ = [
    "base_deployment",
    "default_profiles_dir",
    "disaggregate",
    "load_acceptance_rounds",
    "load_deployment",
    "load_hardware_profile",
    "load_model_config",
    "load_step_table",
    "override_scheduler",
    "select_deployment",
    "split_pd",
    "vary_deployment",
]

#: the tables a model config may hold
_TABLES = ("model", "scheduler", "hardware", "fault", "speculative", "disaggregation", "lora")


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
    raw = read_toml(path)
    base = raw.get("base")
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: base: must be a profile name, got {base!r}")
        base_path = path.parent / f"{base}.toml"
        if not base_path.is_file():
            raise ConfigError(f"{path}: base: no hardware profile {base_path}")
        base_raw = read_toml(base_path)
        if "base" in base_raw:
            raise ConfigError(
                f"{path}: base: {base_path} has a base itself; a base must be a datasheet profile"
            )
        raw = {**base_raw, **raw}
    return structure_table(raw, HardwareProfile, path, "")


def _resolve(file: Path, written: str) -> Path:
    """A path written in ``file``, relative to its directory."""
    path = Path(written).expanduser()
    return path if path.is_absolute() else file.parent / path


def load_acceptance_rounds(file: Path, path: Path, gamma: int, where: str) -> tuple[float, ...]:
    """A CSV of measured speculative-decoding rounds: one accepted draft count per line
    (0..``gamma``; a header line whose first cell is not a number is skipped; further
    cells are ignored). Returns the per-position acceptance rates: the share of rounds
    that accepted at least ``j`` tokens, ``j = 1..gamma``. ConfigError names the file and
    line."""
    text = read_text(path, f"{file}: {where}")
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
    text = read_text(path, f"{file}: {where}")
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


def _load_speculative(table: Any, file: Path) -> tuple[SpeculativeConfig, tuple[float, ...]]:
    """A model config's ``[speculative]`` table and its per-position acceptance rates (an
    ``acceptance_file``'s read here, its path resolved against the config file's
    directory). Called by :func:`load_model_config`."""
    speculative = structure_table(table, SpeculativeConfig, file, "speculative")
    if speculative.acceptance_file is not None:
        path = _resolve(file, speculative.acceptance_file)
        rates = load_acceptance_rounds(
            file, path, speculative.num_speculative_tokens, "speculative.acceptance_file"
        )
        speculative = attrs.evolve(speculative, acceptance_file=str(path))
    else:
        rates = speculative.rates()
    return speculative, rates


def _load_entry(
    file: Path,
    name: str,
    table: Any,
    sched_raw: Any,
    profiles: Path,
    model: ModelArch,
    speculative: SpeculativeConfig | None,
    rates: tuple[float, ...],
) -> Deployment:
    """The deployment of the model config's ``[hardware.<name>]`` table: the entry, its
    scheduler override over ``[scheduler]``, its profile and step table, checked whole
    (Rule 1). Called by :func:`load_model_config` for each entry."""
    prefix = f"hardware.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{file}: {prefix}: must be a table, got {table!r}")
    entry_raw = dict(table)
    override = entry_raw.pop("scheduler", {})
    if not isinstance(override, Mapping):
        raise ConfigError(f"{file}: {prefix}.scheduler: must be a table, got {override!r}")
    entry = structure_table(entry_raw, HardwareEntry, file, prefix)
    merged = structure_table(
        {**sched_raw, **override}, SchedulerConfig, file, f"{prefix}.scheduler"
    )
    profile_name = entry.profile if entry.profile is not None else name
    profile_path = profiles / f"{profile_name}.toml"
    if not profile_path.is_file():
        key = f"{prefix}.profile" if entry.profile is not None else prefix
        raise ConfigError(f"{file}: {key}: no hardware profile {profile_path}")
    profile = load_hardware_profile(profile_path)
    overheads = profile.overheads if entry.overheads is None else entry.overheads
    if overheads.frontend_latency:  # the API process's time, on top of the scheduler's
        latency = merged.frontend_latency + overheads.frontend_latency
        merged = attrs.evolve(merged, frontend_latency=latency)
    step_table = None
    if entry.step_table is not None:
        step_table = load_step_table(file, entry.step_table, f"{prefix}.step_table")
        entry = attrs.evolve(entry, step_table=step_table.source)
    dep = Deployment(
        model=model,
        scheduler=merged,
        hardware=entry,
        profile=profile,
        hardware_name=name,
        config_path=file,
        step_table=step_table,
        speculative=speculative,
        acceptance_rates=rates,
    )
    _validate_deployment(dep, file, profile_path)
    return dep


def load_model_config(
    path: str | os.PathLike[str], profiles_dir: Path | None = None
) -> ModelConfig:
    """Read and validate a model config and every one of its hardware entries.

    Raises ConfigError (one line: file and key path) on any problem; returns only a
    config in which every deployment is usable.
    """
    file = Path(path)
    raw = read_toml(file)
    for key in raw:
        if key not in _TABLES:
            raise ConfigError(
                f"{file}: {key}: unknown key (a model config holds the tables [model], "
                "[scheduler], [hardware.<name>] and optionally [fault], [speculative], "
                "[disaggregation] and [lora])"
            )
    fault = structure_table(raw["fault"], FaultConfig, file, "fault") if "fault" in raw else None
    speculative: SpeculativeConfig | None = None
    rates: tuple[float, ...] = ()
    if "speculative" in raw:
        speculative, rates = _load_speculative(raw["speculative"], file)
    for key in ("model", "scheduler", "hardware"):
        if key not in raw:
            raise ConfigError(f"{file}: {key}: missing required table [{key}]")
    model = structure_table(raw["model"], ModelArch, file, "model")
    if model.tokenizer is not None:
        model = attrs.evolve(model, tokenizer=str(_resolve_tokenizer(file, model.tokenizer)))
    sched_raw = raw["scheduler"]
    scheduler = structure_table(sched_raw, SchedulerConfig, file, "scheduler")
    hw_tables = raw["hardware"]
    if not isinstance(hw_tables, Mapping) or not hw_tables:
        raise ConfigError(f"{file}: hardware: needs at least one [hardware.<name>] table")
    profiles = profiles_dir if profiles_dir is not None else default_profiles_dir(file)
    deployments: dict[str, Deployment] = {}
    for name, table in hw_tables.items():
        deployments[name] = _load_entry(
            file, name, table, sched_raw, profiles, model, speculative, rates
        )
    lora = structure_table(raw["lora"], LoraConfig, file, "lora") if "lora" in raw else None
    for name, dep in deployments.items():
        deployments[name] = with_lora(dep, lora, f"{file}: lora")
    split = None
    if "disaggregation" in raw:
        if lora is not None:
            raise ConfigError(f"{file}: lora: not modelled with [disaggregation]")
        split = structure_table(raw["disaggregation"], DisaggregationConfig, file, "disaggregation")
        for dep in deployments.values():  # Rule 1: checked now, for every entry
            disaggregate(dep, split, deployments, f"{file}: disaggregation")
    return ModelConfig(
        path=file,
        model=model,
        scheduler=scheduler,
        deployments=deployments,
        fault=fault,
        speculative=speculative,
        acceptance_rates=rates,
        disaggregation=split,
        lora=lora,
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
        hardware = names[0]
    if hardware not in config.deployments:
        raise ConfigError(
            f"{config.path}: hardware.{hardware}: no such entry (available: {', '.join(names)})"
        )
    dep = config.deployments[hardware]
    if config.disaggregation is not None:
        dep = disaggregate(
            dep, config.disaggregation, config.deployments, f"{config.path}: disaggregation"
        )
    return dep


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
        lora=config.lora,
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
        sched = structure_table(
            merged, SchedulerConfig, Path(where or dep.config_path), "scheduler"
        )
    out = attrs.evolve(dep, hardware=hardware, scheduler=sched)
    profiles = default_profiles_dir(dep.config_path)
    _validate_deployment(out, dep.config_path, profiles / f"{dep.hardware_name}.toml")
    return out


def disaggregate(
    dep: Deployment,
    split: DisaggregationConfig,
    entries: Mapping[str, Deployment],
    where: str,
) -> Deployment:
    """``dep`` split into the pools of ``split`` (``docs/disaggregation.md``): each pool the
    entry it names (default ``dep``'s own) with its replicas, tp and scheduler keys,
    checked as a config entry is; the link from the prefill pool's fabric. ``where``
    prefixes errors (``file: disaggregation``). Raises ConfigError, one line."""
    if dep.speculative is not None:
        raise ConfigError(f"{where}: not modelled with [speculative] (a drafter per pool)")
    pools: dict[str, Deployment] = {}
    routers: dict[str, str] = {}
    for role, pool, allowed in (
        ("prefill", split.prefill, ROUTERS),
        ("decode", split.decode, DECODE_ROUTERS),
    ):
        base = dep
        if pool.hardware is not None:
            if pool.hardware not in entries:
                raise ConfigError(
                    f"{where}.{role}.hardware: no entry {pool.hardware!r} "
                    f"(available: {', '.join(entries)})"
                )
            base = entries[pool.hardware]
        if base.hardware.dp_attention > 1:
            raise ConfigError(
                f"{where}.{role}: data-parallel attention ranks are not modelled in a pool"
            )
        router = pool.router or "least_loaded"
        if router not in allowed:
            raise ConfigError(
                f"{where}.{role}.router: must be one of {', '.join(allowed)}, got {router!r}"
            )
        routers[role] = router
        pools[role] = vary_deployment(
            base,
            tp=pool.tp,
            replicas=pool.replicas,
            scheduler=pool.scheduler or None,
            where=f"{where}.{role}",
        )
    prefill, decode = pools["prefill"], pools["decode"]
    if prefill.scheduler.block_size != decode.scheduler.block_size:
        raise ConfigError(
            f"{where}: the pools' block_size differ ({prefill.scheduler.block_size} and "
            f"{decode.scheduler.block_size}); the KV cache moves block by block"
        )
    fabric = prefill.profile.fabric
    if fabric is None:
        raise ConfigError(
            f"{where}: the prefill pool's hardware profile ({prefill.profile.name}) has no "
            "[fabric] table: the link between the pools is priced from it"
        )
    gpus = prefill.hardware.tp * prefill.hardware.replicas
    gpus += decode.hardware.tp * decode.hardware.replicas
    name = split.link
    if name == "auto":
        name = "scale_up" if gpus <= fabric.gpus_per_node else "scale_out"
    link = fabric.scale_up if name == "scale_up" else fabric.scale_out
    if link is None:
        raise ConfigError(
            f"{where}.link: the pools span {gpus} GPUs, more than a node's "
            f"{fabric.gpus_per_node}, and the profile has no fabric.scale_out"
        )
    return attrs.evolve(
        dep,
        disaggregation=Disaggregation(
            prefill=prefill,
            decode=decode,
            prefill_router=routers["prefill"],
            decode_router=routers["decode"],
            link=link,
            link_name=name,
            streams=min(prefill.hardware.tp, decode.hardware.tp),
            overlap=split.overlap,
            handoff_latency=split.handoff_latency,
        ),
    )


def split_pd(dep: Deployment, prefill_replicas: int, decode_replicas: int) -> Deployment:
    """``--pd xPyD`` (``sim`` and ``plan``): ``dep``, an aggregated deployment, split into
    ``x`` prefill and ``y`` decode replicas of its own entry with the default
    ``[disaggregation]`` keys (link, overlap, hand-off latency). A deployment whose config
    has a ``[disaggregation]`` table is split already: a :class:`ConfigError`."""
    base = DisaggregationConfig()
    if dep.disaggregation is not None:
        raise ConfigError(
            f"{dep.config_path}: --pd: the deployment is split already by [disaggregation]"
        )
    split = attrs.evolve(
        base,
        prefill=attrs.evolve(base.prefill, replicas=prefill_replicas),
        decode=attrs.evolve(base.decode, replicas=decode_replicas),
    )
    return disaggregate(dep, split, {}, f"{dep.config_path}: --pd")
