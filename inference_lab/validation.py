"""Edge validation: the one strict cattrs toolkit for config files and HTTP bodies.

Config files (:mod:`inference_lab.core.config`) and request bodies
(:mod:`inference_lab.api.schema`) are structured by converters built here; each edge only
chooses whether unknown keys are errors and how a complaint is worded for its readers.

Rule 1: scalars are never coerced: ``7.9`` is not an int, ``true`` is not an int,
        ``"false"`` is not a bool, a string is not a number (an int is accepted where a
        float is expected). A string must be valid Unicode: a lone surrogate (JSON
        ``"\\ud800"``) is refused here, so no later ``encode`` can fail on client input.
Rule 2: containers are checked before they are walked: a list field gets an array, a
        class field gets a mapping, or the complaint names the value it got.
Rule 3: every complaint about one value is an :class:`Invalid` (a type or range: what was
        expected and what came) or a :class:`FieldError` (any other sentence); the
        walker :func:`error_leaves` turns a cattrs error tree into its leaves, each with
        the key path (``messages[0].content``) and the metadata of the innermost attrs
        field, in document order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn

__all__ = [
    "FieldError",
    "Invalid",
    "Leaf",
    "error_leaves",
    "join_path",
    "make_strict_converter",
]


class Invalid(ValueError):
    """A value is not what was ``expected`` (e.g. ``"an integer >= 1"``).

    Raised by the strict hooks and by range validators; ``field`` names the attribute when
    an attrs validator raises it (the walker adds it to the path). ``str()`` is the tail
    of a config message, ``must be an integer, got 7.9``; the HTTP edge renders ``value``
    as JSON instead.
    """

    def __init__(self, expected: str, value: Any, field: str | None = None) -> None:
        super().__init__(f"must be {expected}, got {value!r}")
        self.expected = expected
        self.value = value
        self.field = field


class FieldError(ValueError):
    """A validator's complaint about one field in its own words (``str()`` is the tail
    after the key path, e.g. ``is required when arrival_pattern = closed_loop``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


#: One leaf of a cattrs error tree: (key path, the leaf exception, metadata of the
#: innermost attrs field on the path).
Leaf = tuple[str, BaseException, Mapping[str, Any]]


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---------------------------------------------------------------------------------------
# strict hooks


def _strict_int(value: Any, _type: Any) -> int:
    if type(value) is not int:
        raise Invalid("an integer", value)
    return value


def _strict_float(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid("a number", value)
    return float(value)


def _strict_bool(value: Any, _type: Any) -> bool:
    if type(value) is not bool:
        raise Invalid("a boolean", value)
    return value


def check_unicode(value: str) -> bool:
    """True when ``value`` encodes as UTF-8 (has no lone surrogate). Linear, in C."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _strict_str(value: Any, _type: Any) -> str:
    if type(value) is not str:
        raise Invalid("a string", value)
    if not check_unicode(value):
        raise Invalid("a string of valid Unicode (no lone surrogate escapes)", value)
    return value


def _is_list(type_: Any) -> bool:
    return getattr(type_, "__origin__", None) is list


def make_strict_converter(
    *, forbid_extra_keys: bool, mapping_name: str = "an object"
) -> cattrs.Converter:
    """A detailed-validation cattrs converter whose scalar hooks never coerce and whose
    list and attrs-class hooks check the container first (``mapping_name`` words the
    complaint: ``"a table"`` for TOML, ``"an object"`` for JSON)."""
    conv = cattrs.Converter(forbid_extra_keys=forbid_extra_keys, detailed_validation=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)

    def list_factory(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
        inner = list_structure_factory(type_, converter)

        def structure(value: Any, _type: Any) -> Any:
            if type(value) is not list:
                raise Invalid("an array", value)
            return inner(value, type_)

        return structure

    def class_factory(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
        inner = make_dict_structure_fn(type_, converter)

        def structure(value: Any, _type: Any) -> Any:
            if not isinstance(value, Mapping):
                raise Invalid(mapping_name, value)
            return inner(value, type_)

        return structure

    conv.register_structure_hook_factory(_is_list, list_factory)
    conv.register_structure_hook_factory(attrs.has, class_factory)
    return conv


# ---------------------------------------------------------------------------------------
# the error walker


def _field_meta(cls: Any, name: str | None) -> Mapping[str, Any]:
    if cls is None or name is None or not attrs.has(cls):
        return {}
    found = attrs.fields_dict(cls).get(name)
    return found.metadata if found is not None else {}


def error_leaves(
    exc: BaseException,
    path: str = "",
    cls: Any = None,
    meta: Mapping[str, Any] | None = None,
) -> list[Leaf]:
    """Flatten a cattrs error tree into its leaves in document order.

    A validator's :class:`Invalid` or :class:`FieldError` that names a field gets that
    field appended to the path (and that field's metadata); a ForbiddenExtraKeysError is
    one leaf at the path of the mapping that holds the keys.
    """
    here: Mapping[str, Any] = meta if meta is not None else {}
    if isinstance(exc, ClassValidationError | IterableValidationError):
        out: list[Leaf] = []
        with_notes, without = exc.group_exceptions()
        owner = exc.cl if isinstance(exc, ClassValidationError) else None
        for sub, note in with_notes:
            if isinstance(note, AttributeValidationNote):
                out += error_leaves(
                    sub, join_path(path, note.name), note.type, _field_meta(owner, note.name)
                )
            elif isinstance(note, IterableValidationNote):
                out += error_leaves(sub, f"{path}[{note.index}]", note.type, {})
            else:
                out += error_leaves(sub, path, cls, here)
        for sub in without:
            # An exception without a note comes from the class itself (its validators).
            out += error_leaves(sub, path, owner if owner is not None else cls, here)
        return out
    field = getattr(exc, "field", None)
    if isinstance(exc, Invalid | FieldError) and field is not None:
        return [(join_path(path, field), exc, _field_meta(cls, field))]
    return [(path, exc, here)]
