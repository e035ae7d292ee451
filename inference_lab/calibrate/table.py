"""A table of published measurements, one row per measured load level of one model on one
GPU and engine (``docs/fidelity/measurements.csv``'s format), read for ``inference-lab
calibrate --table`` and ``scripts/fidelity.py``.

The columns (docs/fidelity.md#the-measurement-table): where a row comes from (``id``,
``source``, ``table``, ``row``, ``column``, ``engine``), what was run (``scenario``,
``model_config``, ``hardware``, ``entry``, ``tp``, ``isl``, ``osl``, ``range_ratio``,
``level``, ``requests`` and the engine limits ``max_num_seqs``, ``max_num_batched_tokens``,
``gpu_memory_utilization``), what was measured (``output_tps``, ``ttft_ms``, ``tpot_ms``,
``itl_median_ms``) and ``split``. A blank cell is "not given".

Rule 1: the header must name every column, once, and nothing else; every problem is a
        ConfigError of one line naming ``file:line`` and the column: a missing column, a
        value of the wrong kind, a row that measures nothing, a repeated id.
Rule 2: a row becomes a :class:`Case` (:func:`row_cases`): its model config's entry, at the
        row's ``tp`` and engine limits, and the :class:`LoadLevel` that reproduces it: a
        closed loop of ``level`` users (``closed_loop``), ``level`` requests sent at once
        to a server (``burst``), or trtllm-bench's offline run (``offline``, its engine
        limits derived by trtllm-bench's own rule, :func:`trtllm_bench_limits`).
        Lengths drawn uniformly from ``[floor(range_ratio * L), L]`` are re-simulated at
        their mean. A closed loop of fixed lengths (no ``range_ratio``) with its request
        count given is run in lock step (``LoadLevel.lock_step``): every user starting at
        once, the count as measured.
Rule 3: a row is refused before any fit (one line naming the row): a config with no such
        entry, a deployment that cannot hold the weights or one request of the row's
        lengths, and a latency below the datasheet roofline's floor by more than
        :data:`FLOOR_MARGIN` (the price of the row's one request alone on the datasheet
        GPU: no engine beats it), which is what seconds written in a millisecond column
        look like; the message says so and gives the value x 1000.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from inference_lab.calibrate.measurements import LoadLevel, start_spread
from inference_lab.core.config import (
    BYTES_PER_VALUE,
    AttentionLayer,
    Deployment,
    Efficiency,
    ModelConfig,
    load_hardware_profile,
    load_model_config,
)
from inference_lab.core.roofline import Roofline
from inference_lab.errors import ConfigError

__all__ = [
    "COLUMNS",
    "FLOOR_MARGIN",
    "Case",
    "ConfigFinder",
    "TableRow",
    "check_units",
    "datasheet_case",
    "read_table",
    "row_cases",
    "config_finder",
    "trtllm_bench_limits",
]

COLUMNS = (
    "id", "source", "table", "row", "column", "engine", "scenario", "model_config",
    "hardware", "entry", "tp", "isl", "osl", "range_ratio", "level", "requests",
    "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
    "output_tps", "ttft_ms", "tpot_ms", "itl_median_ms", "split",
)  # fmt: skip
SCENARIOS = ("offline", "burst", "closed_loop")
SPLITS = ("fit", "test")
#: The columns a row must fill.
_REQUIRED = (
    "id", "source", "scenario", "model_config", "hardware", "entry", "tp", "isl", "osl",
    "level", "split",
)  # fmt: skip
_INTEGERS = ("tp", "level", "requests", "max_num_seqs", "max_num_batched_tokens")
_NUMBERS = ("isl", "osl", "output_tps", "ttft_ms", "tpot_ms", "itl_median_ms")
#: A measured latency this many times below the datasheet floor is a unit error (Rule 3).
FLOOR_MARGIN = 10.0


@attrs.frozen
class TableRow:
    """One row: its file and line (for messages) and its cells, typed on access."""

    path: Path
    line: int
    cells: dict[str, str]

    def __getitem__(self, key: str) -> str:
        return self.cells[key]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def number(self, key: str) -> float | None:
        """The cell as a positive finite number, None when blank; ConfigError otherwise."""
        text = self.cells[key].strip()
        if text == "":
            return None
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{self.where}: {key}: must be a number, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{self.where}: {key}: must be > 0, got {text!r}")
        return value

    def integer(self, key: str) -> int | None:
        value = self.number(key)
        if value is not None and value != int(value):
            raise ConfigError(f"{self.where}: {key}: must be a whole number, got {self[key]!r}")
        return None if value is None else int(value)

    def measured(self) -> dict[str, float]:
        """The measured metrics in calibrate's units (seconds, output tokens/s)."""
        out = {}
        for metric, key, scale in (
            ("ttft", "ttft_ms", 1e-3),
            ("tpot", "tpot_ms", 1e-3),
            ("itl", "itl_median_ms", 1e-3),
            ("throughput", "output_tps", 1.0),
        ):
            value = self.number(key)
            if value is not None:
                out[metric] = value * scale
        return out


def read_table(path: Path) -> list[TableRow]:
    """Every row of the table at ``path``, checked (Rule 1)."""
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            header = list(reader.fieldnames or ())
            _check_header(path, header)
            rows = [TableRow(path, i, dict(r)) for i, r in enumerate(reader, start=2)]
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    seen: dict[str, int] = {}
    for row in rows:
        _check_row(row)
        if row["id"] in seen:
            raise ConfigError(f"{row.where}: id: {row['id']!r} repeats line {seen[row['id']]}")
        seen[row["id"]] = row.line
    return rows


def _check_header(path: Path, header: list[str]) -> None:
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ConfigError(f"{path}:1: missing column(s) {', '.join(missing)}")
    unknown = [c for c in header if c not in COLUMNS]
    if unknown:
        raise ConfigError(f"{path}:1: unknown column(s) {', '.join(unknown)}")
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise ConfigError(f"{path}:1: repeated column(s) {', '.join(repeated)}")


def _check_row(row: TableRow) -> None:
    if None in row.cells.values() or None in row.cells:
        raise ConfigError(f"{row.where}: must have {len(COLUMNS)} cells")
    for key in _REQUIRED:
        if not row[key].strip():
            raise ConfigError(f"{row.where}: {key}: must not be blank")
    if row["split"] not in SPLITS:
        raise ConfigError(f"{row.where}: split: must be fit or test")
    if row["scenario"] not in SCENARIOS:
        raise ConfigError(f"{row.where}: scenario: must be one of {', '.join(SCENARIOS)}")
    for key in _INTEGERS:
        row.integer(key)
    for key in _NUMBERS:
        row.number(key)
    ratio = row.number("range_ratio")
    if ratio is not None and ratio > 1:
        raise ConfigError(
            f"{row.where}: range_ratio: must be in (0, 1], got {row['range_ratio']!r}"
        )
    memory = row.number("gpu_memory_utilization")
    if memory is not None and memory > 1:
        raise ConfigError(f"{row.where}: gpu_memory_utilization: must be <= 1, got {memory}")
    if not row.measured():
        raise ConfigError(
            f"{row.where}: measures nothing: output_tps, ttft_ms, tpot_ms and itl_median_ms "
            "are blank"
        )


# ---------------------------------------------------------------------------------------
# a row as a deployment and a load level


#: Finds a model config by the name a row gives (``model_config``): a path to load.
ConfigFinder = Callable[[str], Path]


@attrs.frozen
class Case:
    """What re-simulating a row takes: the deployment and the load level (Rule 2)."""

    row: TableRow
    deployment: Deployment
    level: LoadLevel


def _mean_length(row: TableRow, key: str) -> int:
    """The mean of the lengths a row's requests had (Rule 2)."""
    length = row.number(key)
    assert length is not None  # required
    ratio = row.number("range_ratio")
    if ratio is None:
        return max(1, round(length))
    top = round(length)
    return max(1, round((math.floor(ratio * top) + top) / 2))


def row_cases(
    rows: Sequence[TableRow], find: ConfigFinder, profiles_dir: Path | None = None
) -> list[Case]:
    """The case that reproduces each row on its ``entry`` (Rules 2 and 3), each model
    config loaded once."""
    configs: dict[str, ModelConfig] = {}
    cases = []
    for row in rows:
        name = row["model_config"]
        if name not in configs:
            try:
                configs[name] = load_model_config(find(name), profiles_dir)
            except ConfigError as exc:
                raise ConfigError(f"{row.where}: model_config: {exc}") from None
        config = configs[name]
        dep = config.deployments.get(row["entry"])
        if dep is None:
            raise ConfigError(
                f"{row.where}: entry: {config.path.name} has no [hardware.{row['entry']}] "
                f"(it has {', '.join(sorted(config.deployments))})"
            )
        cases.append(_case(row, dep))
    return cases


def _case(row: TableRow, dep: Deployment) -> Case:
    """The row's limits on ``dep``, the fit check, and the load level."""
    tp = row.integer("tp")
    assert tp is not None  # required
    isl, osl = _mean_length(row, "isl"), _mean_length(row, "osl")
    sched = dep.scheduler
    seqs, tokens = row.integer("max_num_seqs"), row.integer("max_num_batched_tokens")
    memory = row.number("gpu_memory_utilization")
    if seqs is not None:
        sched = attrs.evolve(sched, max_num_seqs=seqs)
    if tokens is not None:
        sched = attrs.evolve(sched, max_num_batched_tokens=tokens)
    if memory is not None:
        sched = attrs.evolve(sched, gpu_memory_utilization=memory)
    dep = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, tp=tp), scheduler=sched)
    level_value = row.integer("level")
    assert level_value is not None  # required
    kind = {"offline": "batched", "burst": "batched", "closed_loop": "closed"}[row["scenario"]]
    if row["scenario"] == "offline":
        dep = _trtllm_bench_deployment(row, dep, isl, osl)
    _check_fits(row, dep, isl, osl)
    measured = row.measured()
    requests = row.integer("requests")
    fixed = row.number("range_ratio") is None
    level = LoadLevel(
        source=row.where,
        kind=kind,
        level=level_value,
        prompt_tokens=isl,
        output_tokens=osl,
        requests=requests,
        lock_step=kind == "closed" and fixed and requests is not None,
        ttft=measured.get("ttft"),
        tpot=measured.get("tpot"),
        itl=measured.get("itl"),
        throughput=measured.get("throughput"),
    )
    return Case(row, dep, start_spread(level))


def _check_fits(row: TableRow, dep: Deployment, isl: int, osl: int) -> None:
    """Rule 3: the weights fit the GPUs and one request of the row's lengths fits the KV
    cache."""
    gpus = f"{dep.profile.name} x tp {dep.hardware.tp}"
    if dep.kv_bytes <= 0 or dep.total_blocks == 0:
        raise ConfigError(
            f"{row.where}: {row['model_config']} does not fit {gpus}: its weights take "
            f"{dep.resident_weight_bytes / 1e9:.1f} GB of the "
            f"{dep.profile.memory_capacity * dep.hardware.tp * dep.scheduler.gpu_memory_utilization / 1e9:.1f} GB "
            "the engine may use"
        )
    need = Roofline(attrs.evolve(dep, step_table=None)).blocks_for(isl + osl)
    if need > dep.total_blocks:
        raise ConfigError(
            f"{row.where}: one request of {isl} + {osl} tokens needs {need} KV blocks; "
            f"{row['model_config']} on {gpus} has {dep.total_blocks}"
        )


def datasheet_case(case: Case, profiles_dir: Path) -> Case | None:
    """``case`` on the datasheet profile of its GPU (``hardware_profiles/<hardware>.toml``)
    with no efficiency terms: the uncalibrated roofline. None when the row's request does
    not fit the datasheet memory (a calibrated profile may carry the memory the GPU has)."""
    row = case.row
    profile = load_hardware_profile(profiles_dir / f"{row['hardware']}.toml")
    hw = attrs.evolve(case.deployment.hardware, profile=row["hardware"], efficiency=None)
    dep = attrs.evolve(case.deployment, profile=profile, hardware=hw)
    if row["scenario"] == "offline":
        dep = _trtllm_bench_deployment(row, dep, case.level.prompt_tokens, case.level.output_tokens)
    try:
        _check_fits(row, dep, case.level.prompt_tokens, case.level.output_tokens)
    except ConfigError:
        return None
    return Case(row, dep, case.level)


def check_units(case: Case) -> None:
    """Rule 3: each measured latency against the datasheet floor of the row's request
    alone (its prompt as one prefill, one decode step at its full context)."""
    dep = case.deployment
    datasheet = attrs.evolve(
        dep,
        profile=attrs.evolve(dep.profile, efficiency=Efficiency()),
        hardware=attrs.evolve(dep.hardware, efficiency=None),
        step_table=None,
    )
    roofline = Roofline(datasheet)
    isl = case.level.prompt_tokens
    floors = {
        "ttft": roofline.even_price(1, isl - 1, (isl + 1) // 2),
        "tpot": roofline.even_price(1, 0, isl + 1),
    }
    floors["itl"] = floors["tpot"]
    for metric, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_median_ms")):
        measured = getattr(case.level, metric)
        if measured is None or measured * FLOOR_MARGIN >= floors[metric]:
            continue
        ms = measured * 1e3
        raise ConfigError(
            f"{case.row.where}: {key}: {ms:.4g} ms is {floors[metric] / measured:.0f}x below "
            f"the datasheet floor of {floors[metric] * 1e3:.3g} ms: seconds in a millisecond "
            f"column? ({ms * 1e3:.4g} ms if so)"
        )


# ---------------------------------------------------------------------------------------
# trtllm-bench's engine limits


def trtllm_bench_limits(dep: Deployment, isl: int, osl: int) -> tuple[int, int]:
    """The (max batch, max tokens per step) trtllm-bench picks for ``dep`` at ``isl`` /
    ``osl``: the rule of tensorrt_llm/bench/build/tuning.py (calc_engine_setting,
    finetune_setting), in GiB as it counts, with KV at the model's KV precision."""
    model, tp = dep.model, dep.hardware.tp
    gib = 1024**3
    params = sum(w.resident_params for w in model.weights)
    quantised = [w for w in model.weights if w.precision != "bf16"]
    per_param = BYTES_PER_VALUE[quantised[0].precision] if quantised else 2.0
    attention = [x for x in model.layers if isinstance(x, AttentionLayer)]
    per_token = (
        sum(
            2 * x.count * max(tp, x.kv_heads) * x.head_dim * BYTES_PER_VALUE[x.kv_precision]
            for x in attention
        )
        / gib
    )
    available = dep.profile.memory_capacity * tp / gib - params * per_param / gib
    requests = available * 0.95 / (per_token * (isl + osl))
    raw_batch = min(requests, 4096)
    if raw_batch < 256:
        batch = max(64, 32 * math.ceil(raw_batch / 32))
    elif raw_batch < 1024:
        batch = 128 * math.ceil(raw_batch / 128)
    else:
        batch = 256 * math.ceil(raw_batch / 256)
    raw_tokens = min(raw_batch * (1 + isl / osl), 32768)
    if raw_tokens < 4096:
        tokens = max(2048, 256 * math.ceil(raw_tokens / 256))
    elif raw_tokens < 8192:
        tokens = 512 * math.ceil(raw_tokens / 512)
    else:
        tokens = 1024 * math.ceil(raw_tokens / 1024)
    return batch, tokens


def _trtllm_bench_deployment(row: TableRow, dep: Deployment, isl: int, osl: int) -> Deployment:
    """An ``offline`` row's engine: trtllm-bench's limits, 95 % of the memory for weights
    and KV, and no more requests running than the KV cache holds at their full length
    (TensorRT-LLM's default capacity policy, GUARANTEED_NO_EVICT)."""
    batch, tokens = trtllm_bench_limits(dep, isl, osl)
    sched = attrs.evolve(dep.scheduler, max_num_batched_tokens=tokens, gpu_memory_utilization=0.95)
    dep = attrs.evolve(dep, scheduler=sched)
    if dep.total_blocks == 0:
        return dep  # _check_fits refuses it
    seats = dep.total_blocks // Roofline(attrs.evolve(dep, step_table=None)).blocks_for(isl + osl)
    return attrs.evolve(dep, scheduler=attrs.evolve(sched, max_num_seqs=max(1, min(batch, seats))))


def config_finder(dirs: Sequence[Path]) -> ConfigFinder:
    """A :data:`ConfigFinder` that looks for ``<name>.toml`` in ``dirs`` in order (a name
    that is a path to an existing file is that file)."""

    def find(name: str) -> Path:
        direct = Path(name)
        if direct.suffix == ".toml" and direct.is_file():
            return direct
        for folder in dirs:
            candidate = folder / f"{name}.toml"
            if candidate.is_file():
                return candidate
        raise ConfigError(f"no {name}.toml in {', '.join(str(d) for d in dirs)}")

    return find
