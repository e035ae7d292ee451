"""The field checks of the config classes: attrs validators and converters.

Rule 1: a failed check raises :class:`~inference_lab.validation.FieldError` naming the
        field; its message is the tail of the loader's one line
        (``file: key.path: <message>``).
Rule 2: a bound fails for NaN too (``not value >= lo``); None passes every bound, so an
        optional field is checked only when it is set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from inference_lab.validation import FieldError

__all__ = [
    "ge",
    "gt",
    "le",
    "lowercase",
    "nonempty",
    "one_of",
    "optional_name",
    "optional_nonempty",
]


def ge(lo: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not value >= lo:  # (NaN too)
            raise FieldError(attr.name, f"must be >= {lo}, got {value!r}")

    return check


def gt(lo: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not value > lo:
            raise FieldError(attr.name, f"must be > {lo}, got {value!r}")

    return check


def le(hi: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not value <= hi:  # (NaN too)
            raise FieldError(attr.name, f"must be <= {hi}, got {value!r}")

    return check


def one_of(options: tuple[str, ...]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value not in options:
            raise FieldError(attr.name, f"must be one of {', '.join(options)}; got {value!r}")

    return check


def optional_nonempty(_inst: Any, attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value:
        raise FieldError(attr.name, "must be a non-empty path")


def optional_name(_inst: Any, attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value:
        raise FieldError(attr.name, "must be a non-empty name")


def lowercase(value: str) -> str:
    return value.lower() if isinstance(value, str) else value


def nonempty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if len(value) == 0:
        raise FieldError(attr.name, "must have at least one entry")
