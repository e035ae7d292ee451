"""Reading a workload file (``configs/workloads/<name>.toml``) and the files it points at.

Rule 1: every error is a ConfigError of one line naming the file and the key (or the
        file and line of a rate schedule's points file).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import attrs

from inference_lab.core.config.convert import read_text, read_toml, structure_table
from inference_lab.core.config.workload import Workload
from inference_lab.errors import ConfigError
from inference_lab.traffic.schedules import PiecewiseRate, check_points
from inference_lab.validation import FieldError

__all__ = ["load_workload"]


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Read and validate a workload TOML; raises ConfigError. A piecewise schedule's
    ``points_file`` is read (relative to the workload file) into its points."""
    file = Path(path)
    workload = structure_table(read_toml(file), Workload, file, "")
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
    text = read_text(path, where)
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
