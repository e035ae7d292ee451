"""The axes of a plan spec's candidate space: integer axes, scheduler knobs, P/D splits.

Rule 1: an axis is a value, a list, or a range table ``{start, stop}`` with ``step`` or
        ``factor`` (``stop`` included); its values are checked when the spec is loaded
        (integers in range, scheduler values through the strict converter), each problem
        one ConfigError line naming the file and the key (``plan.toml: tp: ...``).
Rule 2: ``disaggregation`` is an axis of splits: a list of ``xPyD`` names (``"2P1D"``:
        two prefill replicas, one decode replica of the candidate's entry and tp), or a
        table ``{prefill = axis, decode = axis}`` whose cross product is taken. Each pool
        has at least one replica.
Rule 3: ``gpu_budget`` bounds every candidate's GPUs. A value of an axis that can fit no
        candidate under it (a listed split or a replica count with more replicas than
        the budget, a tp above it) is an error naming the key; a split table's pairs over
        it are left out of the axis, and a table that keeps none is an error.

Who calls this: :mod:`inference_lab.plan.spec` (``load_spec``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from inference_lab.core.config import SchedulerConfig, structure_table
from inference_lab.errors import ConfigError

__all__ = [
    "MAX_AXIS_VALUE",
    "MAX_AXIS_VALUES",
    "MAX_REPLICAS",
    "Split",
    "check_budget",
    "int_axis",
    "is_int",
    "scheduler_axes",
    "split_axis",
]

#: Most values a range table of an axis may hold, and the largest value of an integer
#: axis (a range to 10**12 would be built as a list before anything else is checked).
MAX_AXIS_VALUES = 1_000
MAX_AXIS_VALUE = 100_000_000
#: Most replicas of a candidate (each is a simulated worker with its own KV cache).
MAX_REPLICAS = 1_024


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_axis(raw: Any, file: Path, key: str, top: int = MAX_AXIS_VALUE) -> tuple[int, ...]:
    """An axis of integers in ``1..top``: a value, a list, or a range table ``{start,
    stop}`` with ``step`` (default 1) or ``factor`` (geometric); ``stop`` is included. A
    range holds at most :data:`MAX_AXIS_VALUES` values."""
    where = f"{file}: {key}"
    if is_int(raw):
        values: list[Any] = [raw]
    elif isinstance(raw, list):
        values = raw
    elif isinstance(raw, Mapping):
        values = _range_values(raw, where)
    else:
        raise ConfigError(
            f"{where}: must be an integer, a list or a range table {{start, stop}}, got {raw!r}"
        )
    if not values:
        raise ConfigError(f"{where}: must have at least one value")
    for v in values:
        if not is_int(v) or v < 1:
            raise ConfigError(f"{where}: every value must be an integer >= 1, got {v!r}")
        if v > top:
            raise ConfigError(f"{where}: every value must be at most {top:,}, got {v!r}")
    return tuple(dict.fromkeys(values))


def _range_values(raw: Mapping[str, Any], where: str) -> list[Any]:
    """A range table's values (``int_axis``): ``start`` to ``stop`` included, by ``step``
    or geometric by ``factor``. A stepped range of more than :data:`MAX_AXIS_VALUES`
    values is an error; a geometric one stops after that many."""
    extra = set(raw) - {"start", "stop", "step", "factor"}
    if extra:
        raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown key (start, stop, step, factor)")
    for name in ("start", "stop"):
        if not is_int(raw.get(name)):
            raise ConfigError(f"{where}.{name}: must be an integer, got {raw.get(name)!r}")
    start, stop = raw["start"], raw["stop"]
    if "step" in raw and "factor" in raw:
        raise ConfigError(f"{where}: give step or factor, not both")
    values: list[Any] = []
    if "factor" in raw:
        factor = raw["factor"]
        if not is_int(factor) or factor < 2:
            raise ConfigError(f"{where}.factor: must be an integer >= 2, got {factor!r}")
        v = start
        while v <= stop and len(values) <= MAX_AXIS_VALUES:
            values.append(v)
            v *= factor
    else:
        step = raw.get("step", 1)
        if not is_int(step) or step < 1:
            raise ConfigError(f"{where}.step: must be an integer >= 1, got {step!r}")
        span = range(start, stop + 1, step)
        if len(span) > MAX_AXIS_VALUES:
            raise ConfigError(
                f"{where}: the range holds {len(span):,} values, more than "
                f"{MAX_AXIS_VALUES:,}: raise step or use a factor"
            )
        values = list(span)
    return values


_KNOB_FIELDS = tuple(a.name for a in attrs.fields(SchedulerConfig))


def scheduler_axes(raw: Any, file: Path) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{file}: scheduler: must be a table, got {raw!r}")
    out = []
    for name, value in raw.items():
        key = f"scheduler.{name}"
        if name not in _KNOB_FIELDS:
            raise ConfigError(
                f"{file}: {key}: unknown key (a scheduler setting: {', '.join(_KNOB_FIELDS)})"
            )
        if isinstance(value, Mapping) or is_int(value):
            values: tuple[Any, ...] = int_axis(value, file, key)
        elif isinstance(value, list):
            values = tuple(value)
        else:
            values = (value,)
        if not values:
            raise ConfigError(f"{file}: {key}: must have at least one value")
        for v in values:  # the strict converter checks each value on a neutral base
            base = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, name: v}
            structure_table(base, SchedulerConfig, file, "scheduler")
        out.append((name, values))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# prefill/decode splits (Rules 2 and 3)

_XPYD = re.compile(r"([0-9]+)P([0-9]+)D", re.IGNORECASE)


@attrs.frozen(order=True)
class Split:
    """``xPyD``: ``prefill`` prefill replicas and ``decode`` decode replicas, each of the
    candidate's entry and tp (docs/disaggregation.md)."""

    prefill: int
    decode: int

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"{self.prefill}P{self.decode}D"


def _named_split(value: Any, where: str, budget: int | None) -> Split:
    match = _XPYD.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f'{where}: expected a split such as "2P1D", got {value!r}')
    split = Split(int(match[1]), int(match[2]))
    if split.prefill < 1 or split.decode < 1:
        raise ConfigError(f"{where}: {value}: each pool needs at least one replica")
    if max(split.prefill, split.decode) > MAX_REPLICAS:
        raise ConfigError(f"{where}: {value}: a pool holds at most {MAX_REPLICAS:,} replicas")
    if budget is not None and split.replicas > budget:
        raise ConfigError(
            f"{where}: {split.name} uses at least {split.replicas} GPUs (tp 1), more than "
            f"gpu_budget = {budget}"
        )
    return split


def split_axis(raw: Any, file: Path, budget: int | None) -> tuple[Split, ...]:
    """The ``disaggregation`` axis (Rules 2 and 3), in the order written (a table's:
    prefill counts, then decode counts), without repeats."""
    where = f"{file}: disaggregation"
    if isinstance(raw, str):
        raw = [raw]
    if isinstance(raw, list):
        if not raw:
            raise ConfigError(f"{where}: must have at least one split")
        splits = [_named_split(v, where, budget) for v in raw]
    elif isinstance(raw, Mapping):
        for name in raw:
            if name not in ("prefill", "decode"):
                raise ConfigError(f"{where}.{name}: unknown key (prefill, decode)")
        for name in ("prefill", "decode"):
            if name not in raw:
                raise ConfigError(
                    f"{where}.{name}: missing: the pool's replica counts (an integer, a list "
                    "or a range table)"
                )
        xs = int_axis(raw["prefill"], file, "disaggregation.prefill", MAX_REPLICAS)
        ys = int_axis(raw["decode"], file, "disaggregation.decode", MAX_REPLICAS)
        splits = [Split(x, y) for x in xs for y in ys if budget is None or x + y <= budget]
        if not splits:
            raise ConfigError(f"{where}: no split of its ranges fits gpu_budget = {budget}")
        if len(splits) > MAX_AXIS_VALUES:
            raise ConfigError(
                f"{where}: {len(splits):,} splits, more than {MAX_AXIS_VALUES:,}: narrow the "
                "ranges or set gpu_budget"
            )
    else:
        raise ConfigError(
            f'{where}: must be a list of splits (["1P1D", "2P1D"]) or a table {{prefill, '
            f"decode}} of replica axes, got {raw!r}"
        )
    return tuple(dict.fromkeys(splits))


def check_budget(values: tuple[int, ...], file: Path, key: str, budget: int | None) -> None:
    """Rule 3 for the ``tp`` and ``replicas`` axes: each value fits the budget at the
    other axis's smallest value (1)."""
    if budget is None:
        return
    for v in values:
        if v > budget:
            what = (
                f"tp {v} uses {v} GPUs per replica"
                if key == "tp"
                else (f"{v} replicas use at least {v} GPUs")
            )
            raise ConfigError(f"{file}: {key}: {what}, more than gpu_budget = {budget}")
