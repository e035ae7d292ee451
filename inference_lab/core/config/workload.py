"""A workload (``configs/workloads/<name>.toml``): arrivals, lengths, sessions.

Rule 1: a class is valid at construction or raises a FieldError naming the field (a
        closed loop needs its users, a run needs a bound, a rate schedule applies to
        poisson and uniform arrivals only).
Rule 2: every draw comes from the caller's numpy generator; a length is floored and at
        least 1, a duration is not floored and at least 0.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from inference_lab.core.config.checks import ge, gt, le, lowercase, one_of
from inference_lab.traffic.schedules import RateSchedule
from inference_lab.validation import FieldError

__all__ = [
    "ARRIVAL_PATTERNS",
    "AdapterMix",
    "ExponentialTime",
    "FixedDist",
    "FixedTime",
    "LengthDist",
    "LognormalDist",
    "LognormalTime",
    "NormalDist",
    "SessionConfig",
    "TimeDist",
    "UniformDist",
    "UniformTime",
    "Workload",
]

ARRIVAL_PATTERNS = ("poisson", "uniform", "burst", "batched", "closed_loop")


def _floor_at_least_one(values: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
    out: np.ndarray[Any, np.dtype[np.int64]] = np.maximum(np.floor(values), 1).astype(np.int64)
    return out


@attrs.frozen(kw_only=True)
class FixedDist:
    type: str = "fixed"
    value: float = attrs.field(validator=ge(1))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return _floor_at_least_one(np.full(size, self.value, dtype=np.float64))


@attrs.frozen(kw_only=True)
class UniformDist:
    type: str = "uniform"
    min: int = attrs.field(validator=ge(1))
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
    std_dev: float = attrs.field(validator=ge(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return _floor_at_least_one(rng.normal(self.mean, self.std_dev, size=size))


@attrs.frozen(kw_only=True)
class LognormalDist:
    type: str = "lognormal"
    mean: float
    std_dev: float = attrs.field(validator=ge(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return _floor_at_least_one(rng.lognormal(self.mean, self.std_dev, size=size))


LengthDist = FixedDist | UniformDist | NormalDist | LognormalDist


# durations (seconds, not floored; >= 0)


@attrs.frozen(kw_only=True)
class FixedTime:
    type: str = "fixed"
    value: float = attrs.field(validator=ge(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        return np.full(size, float(self.value), dtype=np.float64)


@attrs.frozen(kw_only=True)
class UniformTime:
    type: str = "uniform"
    min: float = attrs.field(validator=ge(0))
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
    mean: float = attrs.field(validator=gt(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        return rng.exponential(self.mean, size=size)


@attrs.frozen(kw_only=True)
class LognormalTime:
    type: str = "lognormal"
    mean: float
    std_dev: float = attrs.field(validator=ge(0))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        return rng.lognormal(self.mean, self.std_dev, size=size)


TimeDist = FixedTime | UniformTime | ExponentialTime | LognormalTime


@attrs.frozen(kw_only=True)
class SessionConfig:
    """A workload's ``[sessions]`` table: multi-turn conversations. The workload's
    ``input_len_dist`` is then the new user tokens of each turn and ``output_len_dist``
    each answer; its arrival pattern starts sessions (``closed_loop``: each user runs
    sessions back to back)."""

    num_sessions: int | None = attrs.field(default=None, validator=ge(1))
    turns: LengthDist
    think_time: TimeDist = attrs.field(factory=lambda: FixedTime(value=0.0))
    system_prompt_tokens: int = attrs.field(default=0, validator=ge(0))
    shared_system_prompt: bool = True


@attrs.frozen(kw_only=True)
class AdapterMix:
    """``[adapters]``: how requests spread over the deployment's LoRA adapters
    (docs/lora.md). ``zipf`` s: the i-th adapter of ``[lora]`` (from 0) has weight ``1 /
    (i + 1) ** s``; or ``weights``: adapter name -> weight. ``base_share``: the share of
    requests to the base model."""

    zipf: float | None = attrs.field(default=None, validator=ge(0))
    weights: dict[str, float] | None = None
    base_share: float = attrs.field(default=0.0, validator=[ge(0), le(1)])

    def __attrs_post_init__(self) -> None:
        if (self.zipf is None) == (self.weights is None):
            raise FieldError("zipf", "set exactly one of zipf and weights")
        if self.weights is not None:
            if not self.weights:
                raise FieldError("weights", "must name at least one adapter")
            for name, w in self.weights.items():
                if not w > 0:
                    raise FieldError(f"weights.{name}", f"must be > 0, got {w!r}")


@attrs.frozen(kw_only=True)
class Workload:
    arrival_pattern: str = attrs.field(converter=lowercase, validator=one_of(ARRIVAL_PATTERNS))
    arrival_rate: float = attrs.field(default=1.0, validator=gt(0))
    num_concurrent_users: int | None = attrs.field(default=None, validator=ge(1))
    closed_loop_jitter_secs: float = attrs.field(default=0.0, validator=ge(0))
    input_len_dist: LengthDist
    output_len_dist: LengthDist
    num_requests: int | None = attrs.field(default=None, validator=ge(1))
    duration_secs: float | None = attrs.field(default=None, validator=gt(0))
    seed: int = attrs.field(default=0, validator=ge(0))  # docs/configuration.md
    sessions: SessionConfig | None = None
    rate_schedule: RateSchedule | None = None
    adapters: AdapterMix | None = None

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
