"""Positional constructors for the frozen records the engine makes every step.

A slotted frozen attrs class's ``__init__`` sets each field through ``object.__setattr__``
with keyword arguments: a few microseconds for a record the engine builds once or twice
per step (``StepEvents``, ``StepInfo``, the roofline's ``StepCost``) or per request
(``Finished``). :func:`frozen_builder` gives a constructor that takes every field
positionally, in the class's field order, and sets it through the class's own slot
descriptor: the same object, in about half the time.

Rule 1: a built object equals the one ``__init__`` gives from the same values, field for
        field: every field is set, in field order; a class with a converter, a validator,
        an ``__attrs_post_init__`` or a default factory on a field is refused (its
        ``__init__`` does more than set slots).
Rule 2: a field with a default may be left out (trailing arguments take their defaults,
        as the class's own defaults are immutable values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs

T = TypeVar("T")


def frozen_builder(cls: type[T]) -> Callable[..., T]:
    """A positional constructor for the slotted frozen attrs class ``cls`` (Rule 1)."""
    fields = attrs.fields(cast(Any, cls))
    if hasattr(cls, "__attrs_post_init__"):
        raise TypeError(f"{cls.__name__} has __attrs_post_init__")
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    params = []
    body = []
    for f in fields:
        if f.converter is not None or f.validator is not None:
            raise TypeError(f"{cls.__name__}.{f.name} has a converter or a validator")
        if isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            raise TypeError(f"{cls.__name__}.{f.name} has a default factory")
        slot = cls.__dict__[f.name]  # the member descriptor of a slotted class
        namespace[f"_set_{f.name}"] = slot.__set__
        if f.default is attrs.NOTHING:
            params.append(f.name)
        else:
            namespace[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        body.append(f"    _set_{f.name}(o, {f.name})\n")
    source = f"def build({', '.join(params)}):\n    o = _new(_cls)\n{''.join(body)}    return o\n"
    exec(source, namespace)  # as attrs writes its own __init__
    build: Callable[..., T] = namespace["build"]
    build.__doc__ = f"A {cls.__name__} from its fields, in order (:mod:`{__name__}`)."
    return build
