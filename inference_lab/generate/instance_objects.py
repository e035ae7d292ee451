"""Which properties a generated object has (:mod:`inference_lab.generate.instances`): the
required ones, some optional ones, names that ``propertyNames``, ``additionalProperties``
and ``patternProperties`` allow, the ``dependentRequired`` closure, ``minProperties`` /
``maxProperties``.

Rule 1: every name checked and every dependency followed spends from the request's
        budget (``validator.budget``); membership is a set beside the ordered list, so
        10,000 required names cost 10,000 steps, not their square.
Rule 2: the names come out in the schema's declared order, then the others in the order
        chosen; every choice comes from the caller's generator.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from inference_lab.generate.patterns import PatternError, pattern_string
from inference_lab.generate.validator import Unsatisfiable, Validator, _count, _mapping
from inference_lab.generate.vocabulary import VOCABULARY

__all__ = ["NameChooser"]

_WORDS = VOCABULARY


def _cap(
    names: list[str], hi: int, required: list[str], dependents: dict[str, list[str]], path: str
) -> list[str]:
    """``names`` cut to ``maxProperties`` ``hi``, the required ones and their dependents
    first (Unsatisfiable when those alone are more)."""
    keep = set(required)
    for name in required:
        keep.update(dependents.get(name, ()))
    names = [n for n in names if n in keep] + [n for n in names if n not in keep]
    names = names[: max(hi, len(keep))]
    if len(names) > hi:
        raise Unsatisfiable(
            path, f"maxProperties {hi} is below the {len(keep)} required properties"
        )
    return names


class NameChooser:
    """Chooses an object's property names (Rules 1-2)."""

    def __init__(self, validator: Validator, rng: random.Random) -> None:
        self.validator = validator
        self.budget = validator.budget
        self.rng = rng

    def choose(
        self,
        conj: list[dict[str, Any]],
        path: str,
        soft: bool,
        declared: list[str],
        required: list[str],
        dependents: dict[str, list[str]],
        lo: int,
    ) -> tuple[list[str], set[str]]:
        """The properties an object will have, in order, and those it must have."""
        hi_values = [_count(s, "maxProperties", path, 0) for s in conj if "maxProperties" in s]
        hi = min(hi_values) if hi_values else None
        for name in required:
            if not self.name_allowed(conj, name, path):
                raise Unsatisfiable(
                    f"{path}/required", f"property {name!r} is required but not allowed"
                )
        chosen = _Names(required)
        for name in declared:
            if name not in chosen and not soft and self.rng.random() < 0.6:
                if self.name_allowed(conj, name, path):
                    chosen.add(name)
        self._close_dependents(chosen, dependents, conj, path)
        if len(chosen) < lo:
            self._fill(chosen, lo, conj, path, declared, dependents)
        if len(chosen) < lo:
            raise Unsatisfiable(path, f"minProperties {lo}: not enough properties are allowed")
        names = chosen.order
        if hi is not None and len(names) > hi:
            names = _cap(names, hi, required, dependents, path)
        picked, known = set(names), set(declared)
        ordered = [n for n in declared if n in picked] + [n for n in names if n not in known]
        must = set(required)
        for name in ordered:
            must.update(dependents.get(name, ()))
        return ordered, must

    def _fill(
        self,
        chosen: _Names,
        lo: int,
        conj: list[dict[str, Any]],
        path: str,
        declared: list[str],
        dependents: dict[str, list[str]],
    ) -> None:
        """Up to ``lo`` names in ``chosen`` (``minProperties``): declared ones first, each
        with its dependents, then names the object's schemas allow beyond them."""
        for name in declared:
            if len(chosen) >= lo:
                break
            if name not in chosen and self.name_allowed(conj, name, path):
                chosen.add(name)
                self._close_dependents(chosen, dependents, conj, path)
        for name in self._extra_names(conj, path, set(chosen.order)):
            if len(chosen) >= lo:
                break
            chosen.add(name)

    def _close_dependents(
        self,
        chosen: _Names,
        dependents: dict[str, list[str]],
        conj: list[dict[str, Any]],
        path: str,
    ) -> None:
        i = 0
        while i < len(chosen):
            for needed in dependents.get(chosen.order[i], ()):
                self.budget.spend()
                if needed not in chosen:
                    if not self.name_allowed(conj, needed, path):
                        raise Unsatisfiable(
                            f"{path}/dependentRequired", f"{needed!r} is needed but not allowed"
                        )
                    chosen.add(needed)
            i += 1

    def name_allowed(self, conj: list[dict[str, Any]], name: str, path: str) -> bool:
        for s in conj:
            self.budget.spend()
            if "propertyNames" in s and not self.validator.valid(
                s["propertyNames"], name, f"{path}/propertyNames", 0
            ):
                return False
            if s.get("additionalProperties") is False:
                if name not in _mapping(s, "properties", path) and not any(
                    self.validator.search(c, name, f"{path}/patternProperties")
                    for c, _ in self.validator.pattern_properties(s, path)
                ):
                    return False
        return True

    def _extra_names(self, conj: list[dict[str, Any]], path: str, taken: set[str]) -> Iterator[str]:
        for word in [*_WORDS, *(f"{a}_{b}" for a in _WORDS[:10] for b in _WORDS[:10])]:
            if word not in taken and self.name_allowed(conj, word, path):
                yield word
        for s in conj:
            for regex, _sub in self.validator.pattern_properties(s, path):
                for _ in range(4):
                    try:
                        name = pattern_string(regex, self.rng, budget=self.budget)
                    except PatternError:
                        break
                    if name not in taken and self.name_allowed(conj, name, path):
                        taken.add(name)
                        yield name


class _Names:
    """Property names in the order they were chosen, with a set beside for membership."""

    __slots__ = ("order", "_set")

    def __init__(self, names: list[str]) -> None:
        self.order = list(names)
        self._set = set(names)

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def __len__(self) -> int:
        return len(self.order)

    def add(self, name: str) -> None:
        if name not in self._set:
            self._set.add(name)
            self.order.append(name)
