"""The config files' strict converter: reading TOML, structuring it into the config
classes, and the one-line errors.

Rule 1: every file goes through one strict cattrs converter (built by
        :mod:`inference_lab.validation`) into ``@attrs.frozen`` classes. Unknown keys are
        errors; scalars are never coerced (``7.9`` is not an int, ``"false"`` is not a
        bool; an int is accepted where a float is expected).
Rule 2: every error is a :class:`ConfigError` whose message is one line naming the file and
        the key path (``configs/x.toml: scheduler.max_num_seqs: must be >= 1, got 0``); an
        unknown key is reported first, with the key it was probably meant to be.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
from cattrs.errors import ForbiddenExtraKeysError

from inference_lab.core.config.model import AttentionLayer, Layer, LinearLayer, MLALayer
from inference_lab.core.config.workload import (
    ExponentialTime,
    FixedDist,
    FixedTime,
    LengthDist,
    LognormalDist,
    LognormalTime,
    NormalDist,
    TimeDist,
    UniformDist,
    UniformTime,
)
from inference_lab.errors import ConfigError
from inference_lab.traffic.schedules import PiecewiseRate, RateSchedule, SineRate, SquareRate
from inference_lab.validation import (
    FieldError,
    Invalid,
    error_leaves,
    join_path,
    make_strict_converter,
)

__all__ = ["CONVERTER", "read_text", "read_toml", "structure_table"]

T = TypeVar("T")

_DISTS: dict[str, type[Any]] = {
    "fixed": FixedDist,
    "uniform": UniformDist,
    "normal": NormalDist,
    "lognormal": LognormalDist,
}
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


def structure_table(raw: Any, cls: type[T], file: Path, path: str = "") -> T:
    """``raw`` (a TOML table) as ``cls`` through the strict converter; ConfigError with
    ``file: key.path: message`` (Rules 1-2): every loader's structuring, and the planner's
    spec (whose loader lives elsewhere)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{file}: {path or '(top level)'}: must be a table, got {raw!r}")
    try:
        return CONVERTER.structure(raw, cls)
    except Exception as exc:  # noqa: BLE001 - every structuring failure becomes a ConfigError
        lines = _error_lines(exc, path)
        key, message = lines[0] if lines else (path, str(exc))
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise ConfigError(f"{file}: {key or '(top level)'}: {message}{more}") from None


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's top-level table; ConfigError naming the file when it is missing,
    unreadable or invalid."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:  # (tomllib recurses into nested arrays and inline tables)
        raise ConfigError(f"{path}: invalid TOML: nested too deep") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the bytes itself
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}); a TOML file must be UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None


def read_text(path: Path, where: str) -> str:
    """The UTF-8 text of a file a config names; ConfigError starting with ``where`` (the
    config file and key) when it is missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc}") from None
