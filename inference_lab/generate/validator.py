"""JSON Schema validation of generated instances, in bounded work, and the schema
keywords read strictly (:mod:`inference_lab.generate.instances` generates the instances).

Rule 1: :func:`is_valid` follows JSON Schema 2020-12 for the keywords
        :mod:`~inference_lab.generate.instances` generates (draft 4-7 spellings too: boolean
        ``exclusiveMinimum``, array ``items`` with ``additionalItems``, ``definitions``,
        ``dependencies``); ``format`` is an annotation there, as in the specification's
        default. Unknown keywords are ignored.
Rule 2: a keyword of the wrong type raises :class:`InvalidSchema` naming its path.
Rule 3: every schema visited, every value compared and every pattern step spends from the
        request's :class:`~inference_lab.generate.budget.Budget`; ``OutOfWork`` leaves named
        with the schema path being checked. Equality of JSON values goes through
        :func:`value_key` (a hashable key, one unit per node), so ``enum``,
        ``uniqueItems`` and ``const`` cost what their values hold, not its square.
Rule 4: a pattern is compiled once per request (:class:`Patterns`) and its compilation
        spent once, whether the process-wide cache (:mod:`inference_lab.generate.regex`)
        held it or not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any
from urllib.parse import unquote

from inference_lab.generate.budget import Budget, OutOfWork
from inference_lab.generate.regex import PatternError, Regex, compile_regex

__all__ = [
    "MAX_DEPTH",
    "InvalidSchema",
    "Patterns",
    "SchemaError",
    "Schemas",
    "TooExpensive",
    "Unsatisfiable",
    "Validator",
    "is_valid",
    "value_key",
]

#: Nesting deeper than this in every instance is :class:`Unsatisfiable`.
MAX_DEPTH = 16

TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")
#: Work units of one schema checked against one value (about a regex step's time each).
VALID_UNITS = 3


class SchemaError(ValueError):
    """A schema this module cannot generate an instance of; ``path`` is where (a JSON
    pointer into the schema, ``""`` for its root)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path or '/'}: {message}")
        self.path = path
        self.reason = message


class InvalidSchema(SchemaError):
    """The schema is malformed (Rule 2)."""


class Unsatisfiable(SchemaError):
    """No instance satisfies the schema, or none was found within the bounds."""


class TooExpensive(SchemaError):
    """Checking or generating at ``path`` takes more than the request's work budget, or
    its instances run past the output bytes a request may have."""


# ---------------------------------------------------------------------------------------
# JSON values


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _type_of(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "number":
        return _is_number(value)
    if name == "integer":
        return _is_integer(value)
    return False


def value_key(value: Any, budget: Budget) -> Any:
    """A hashable key of a JSON value, equal for equal values (``1 == 1.0``, ``true !=
    1``, objects regardless of key order); one unit of ``budget`` per node."""
    budget.spend()
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        if value != value:  # NaN (Python's json reads it): equal to nothing
            return ("nan", id(value))
        return ("n", value)  # (1 and 1.0 are equal and hash alike)
    if isinstance(value, list):
        return ("l", tuple(value_key(v, budget) for v in value))
    if isinstance(value, dict):
        return ("o", frozenset((k, value_key(v, budget)) for k, v in value.items()))
    return ("?", id(value))


def _is_multiple(value: Any, divisor: Any) -> bool:
    """``multipleOf`` as JSON Schema validators check it in floating point (a float
    divisor: the quotient must be a whole number)."""
    if isinstance(divisor, float):
        try:
            quotient = value / divisor
            return bool(int(quotient) == quotient)
        except OverflowError:
            return bool((Fraction(value) / Fraction(divisor)).denominator == 1)
    return bool(value % divisor == 0)


# ---------------------------------------------------------------------------------------
# references and patterns


def _pointer(root: Any, ref: str) -> Any:
    """The subschema at the local reference ``ref`` (``#`` or ``#/a/b``)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise KeyError(ref)
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node[part]
        else:
            raise KeyError(ref)
    return node


class Schemas:
    """The root schema and its local references (each resolved once per request)."""

    def __init__(self, root: Any, budget: Budget) -> None:
        self.root = root
        self.budget = budget
        self._resolved: dict[str, Any] = {}

    def resolve(self, ref: Any, path: str) -> Any:
        if type(ref) is not str:
            raise InvalidSchema(path, "$ref must be a string")
        if ref in self._resolved:
            return self._resolved[ref]
        self.budget.spend(len(ref) // 16 + 1)
        try:
            target = _pointer(self.root, ref)
        except (KeyError, IndexError, ValueError, TypeError):
            if not ref.startswith("#"):
                raise InvalidSchema(
                    path, f"$ref {ref!r}: only local references ('#/...') are supported"
                ) from None
            raise InvalidSchema(path, f"$ref {ref!r} does not resolve") from None
        self._resolved[ref] = target
        return target


class Patterns:
    """The patterns of one request, compiled once each (Rule 4)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._compiled: dict[str, Regex] = {}
        self._found: dict[tuple[str, str], bool] = {}

    def search(self, regex: Regex, text: str, path: str) -> bool:
        """``regex`` searched in ``text``, each pair once per request (its answer kept:
        every search spent at least a unit per character); work past the budget is
        named at ``path``."""
        key = (regex.pattern, text)
        found = self._found.get(key)
        if found is None:
            try:
                found = regex.search(text, self.budget)
            except OutOfWork as exc:
                raise exc.at(path) from None
            self._found[key] = found
        return found

    def get(self, pattern: str) -> Regex:
        """``pattern`` compiled; raises PatternError or OutOfWork."""
        regex = self._compiled.get(pattern)
        if regex is None:
            regex = compile_regex(pattern, self.budget)
            self._compiled[pattern] = regex
        return regex

    def at(self, pattern: Any, path: str) -> Regex:
        """``pattern`` (a schema's value at ``path``) compiled; InvalidSchema if it is not
        a string or does not compile."""
        if type(pattern) is not str:
            raise InvalidSchema(path, "must be a string")
        try:
            return self.get(pattern)
        except PatternError as exc:
            raise InvalidSchema(path, str(exc)) from None


# ---------------------------------------------------------------------------------------
# validation (Rule 1)


def is_valid(schema: Any, value: Any, root: Any = None, budget: Budget | None = None) -> bool:
    """Whether ``value`` is valid against ``schema`` (local references resolve against
    ``root``, default ``schema``). A malformed schema raises :class:`InvalidSchema`;
    past ``budget`` (default: a whole request's), :class:`TooExpensive`."""
    spend = Budget() if budget is None else budget
    validator = Validator(Schemas(schema if root is None else root, spend), Patterns(spend))
    try:
        return validator.valid(schema, value, "", 0)
    except OutOfWork as exc:
        if exc.what not in ("work", "bytes"):
            raise
        raise TooExpensive(exc.path or "", "checking a value here takes too much work") from None


class Validator:
    """The validator of one request (Rules 1-4)."""

    def __init__(self, schemas: Schemas, patterns: Patterns) -> None:
        self.schemas = schemas
        self.patterns = patterns
        self.budget = schemas.budget
        #: the keys of the schema's own values (``enum`` lists, ``const``), by identity
        self._keys: dict[int, tuple[Any, Any]] = {}

    def schema_key(self, value: Any) -> Any:
        """:func:`value_key` of a value the schema holds, computed once."""
        held = self._keys.get(id(value))
        if held is None or held[0] is not value:
            held = (value, value_key(value, self.budget))
            self._keys[id(value)] = held
        return held[1]

    def enum_keys(self, values: list[Any]) -> frozenset[Any]:
        """The keys of an ``enum`` list, computed once."""
        held = self._keys.get(id(values))
        if held is None or held[0] is not values:
            held = (values, frozenset(value_key(v, self.budget) for v in values))
            self._keys[id(values)] = held
        keys: frozenset[Any] = held[1]
        return keys

    def valid(self, schema: Any, value: Any, path: str, depth: int) -> bool:
        try:
            return self._valid(schema, value, path, depth)
        except OutOfWork as exc:
            raise exc.at(path) from None

    def _valid(self, schema: Any, value: Any, path: str, depth: int) -> bool:
        self.budget.spend(VALID_UNITS)
        if schema is True:
            return True
        if schema is False:
            return False
        if not isinstance(schema, dict):
            raise InvalidSchema(path, "a schema must be an object or a boolean")
        if depth > 4 * MAX_DEPTH:
            raise InvalidSchema(path, "$ref cycles without consuming the instance")
        s = schema
        if not self._applicators(s, value, path, depth):
            return False
        if not self._type_and_values(s, value, path):
            return False
        if _is_number(value):
            return self._number(s, value, path)
        if isinstance(value, str):
            return self._string(s, value, path)
        if isinstance(value, list):
            return self._array(s, value, path, depth)
        if isinstance(value, dict):
            return self._object(s, value, path, depth)
        return True

    def _applicators(self, s: dict[str, Any], value: Any, path: str, depth: int) -> bool:
        """Whether ``value`` passes the schema's applicators, in order: ``$ref``,
        ``allOf``, ``anyOf``, ``oneOf``, ``not``, ``if`` / ``then`` / ``else``."""
        if "$ref" in s:
            target = self.schemas.resolve(s["$ref"], path)
            if not self.valid(target, value, f"{path}/$ref", depth + 1):
                return False
        for i, sub in enumerate(_list(s, "allOf", path)):
            if not self.valid(sub, value, f"{path}/allOf/{i}", depth + 1):
                return False
        any_of = _list(s, "anyOf", path)
        if any_of and not any(
            self.valid(b, value, f"{path}/anyOf/{i}", depth + 1) for i, b in enumerate(any_of)
        ):
            return False
        one_of = _list(s, "oneOf", path)
        if one_of and (
            sum(self.valid(b, value, f"{path}/oneOf/{i}", depth + 1) for i, b in enumerate(one_of))
            != 1
        ):
            return False
        if "not" in s and self.valid(s["not"], value, f"{path}/not", depth + 1):
            return False
        if "if" in s:
            if self.valid(s["if"], value, f"{path}/if", depth + 1):
                if "then" in s and not self.valid(s["then"], value, f"{path}/then", depth + 1):
                    return False
            elif "else" in s and not self.valid(s["else"], value, f"{path}/else", depth + 1):
                return False
        return True

    def _type_and_values(self, s: dict[str, Any], value: Any, path: str) -> bool:
        """Whether ``value`` is of the schema's ``type`` and is its ``const`` and one of
        its ``enum``, when given."""
        types = _types(s, path)
        if types is not None and not any(_type_of(value, t) for t in types):
            return False
        if "const" in s and self.schema_key(s["const"]) != value_key(value, self.budget):
            return False
        if "enum" in s:
            keys = self.enum_keys(_list(s, "enum", f"{path}"))
            if value_key(value, self.budget) not in keys:
                return False
        return True

    def _number(self, s: dict[str, Any], value: Any, path: str) -> bool:
        for lo, exclusive in _lower_bounds(s, path):
            if value < lo or (exclusive and value == lo):
                return False
        for hi, exclusive in _upper_bounds(s, path):
            if value > hi or (exclusive and value == hi):
                return False
        if "multipleOf" in s:
            return _is_multiple(value, _positive_number(s, "multipleOf", path))
        return True

    def _string(self, s: dict[str, Any], value: str, path: str) -> bool:
        n = len(value)
        if n < _count(s, "minLength", path, 0):
            return False
        if "maxLength" in s and n > _count(s, "maxLength", path, 0):
            return False
        if "pattern" in s:
            where = f"{path}/pattern"
            return self.patterns.search(self.patterns.at(s["pattern"], where), value, where)
        return True

    def _array(self, s: dict[str, Any], value: list[Any], path: str, depth: int) -> bool:
        n = len(value)
        if n < _count(s, "minItems", path, 0):
            return False
        if "maxItems" in s and n > _count(s, "maxItems", path, 0):
            return False
        prefix, rest, rest_key = _array_shape(s, path)
        for i, item in enumerate(value):
            if i < len(prefix):
                if not self.valid(prefix[i], item, f"{path}/prefixItems/{i}", depth + 1):
                    return False
            elif rest is not None and not self.valid(rest, item, f"{path}/{rest_key}", depth + 1):
                return False
        if s.get("uniqueItems") is True:
            keys = {value_key(v, self.budget) for v in value}
            if len(keys) < n:
                return False
        if "contains" in s:
            found = sum(self.valid(s["contains"], v, f"{path}/contains", depth + 1) for v in value)
            if found < _count(s, "minContains", path, 1):
                return False
            if "maxContains" in s and found > _count(s, "maxContains", path, 0):
                return False
        return True

    def _object(self, s: dict[str, Any], value: dict[str, Any], path: str, depth: int) -> bool:
        n = len(value)
        if n < _count(s, "minProperties", path, 0):
            return False
        if "maxProperties" in s and n > _count(s, "maxProperties", path, 0):
            return False
        required = _required(s, path)
        self.budget.spend(len(required) // 8 + 1)
        for name in required:
            if name not in value:
                return False
        for name, needed in _dependent_required(s, path).items():
            if name in value and any(d not in value for d in needed):
                return False
        properties = _mapping(s, "properties", path)
        patterns = self.pattern_properties(s, path)
        for name, item in value.items():
            if "propertyNames" in s and not self.valid(
                s["propertyNames"], name, f"{path}/propertyNames", depth + 1
            ):
                return False
            if not self._property(s, name, item, properties, patterns, path, depth):
                return False
        return True

    def _property(
        self,
        s: dict[str, Any],
        name: str,
        item: Any,
        properties: Mapping[str, Any],
        patterns: list[tuple[Regex, Any]],
        path: str,
        depth: int,
    ) -> bool:
        """Whether the property ``name`` holding ``item`` passes its schema in
        ``properties``, each of the ``patternProperties`` its name matches, and, when none
        applied, ``additionalProperties``."""
        matched = False
        if name in properties:
            matched = True
            if not self.valid(properties[name], item, f"{path}/properties", depth + 1):
                return False
        for regex, sub in patterns:
            if self.search(regex, name, f"{path}/patternProperties"):
                matched = True
                if not self.valid(sub, item, f"{path}/patternProperties", depth + 1):
                    return False
        if not matched and "additionalProperties" in s:
            extra = s["additionalProperties"]
            if not self.valid(extra, item, f"{path}/additionalProperties", depth + 1):
                return False
        return True

    def search(self, regex: Regex, text: str, path: str) -> bool:
        """``regex`` searched in ``text`` (once per request: a retried generation checks
        the same strings), work past the budget named at ``path``."""
        return self.patterns.search(regex, text, path)

    def pattern_properties(self, s: Mapping[str, Any], path: str) -> list[tuple[Regex, Any]]:
        where = f"{path}/patternProperties"
        return [
            (self.patterns.at(pattern, where), sub)
            for pattern, sub in _mapping(s, "patternProperties", path).items()
        ]


# ---------------------------------------------------------------------------------------
# reading keywords (each raises InvalidSchema for a value of the wrong type)


def _list(s: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = s.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidSchema(f"{path}/{key}", "must be an array")
    return value


def _mapping(s: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
    value = s.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidSchema(f"{path}/{key}", "must be an object")
    return value


def _types(s: Mapping[str, Any], path: str) -> tuple[str, ...] | None:
    if "type" not in s:
        return None
    value = s["type"]
    names = value if isinstance(value, list) else [value]
    for name in names:
        if name not in TYPES:
            raise InvalidSchema(f"{path}/type", f"unknown type {name!r}")
    return tuple(names)


def _count(s: Mapping[str, Any], key: str, path: str, default: int) -> int:
    if key not in s:
        return default
    value = s[key]
    if not _is_integer(value) or value < 0:
        raise InvalidSchema(f"{path}/{key}", "must be a non-negative integer")
    return int(value)


def _number_value(s: Mapping[str, Any], key: str, path: str) -> Any:
    value = s[key]
    if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidSchema(f"{path}/{key}", "must be a number")
    return value


def _positive_number(s: Mapping[str, Any], key: str, path: str) -> Any:
    value = _number_value(s, key, path)
    if value <= 0:
        raise InvalidSchema(f"{path}/{key}", "must be greater than 0")
    return value


def _lower_bounds(s: Mapping[str, Any], path: str) -> list[tuple[Any, bool]]:
    out: list[tuple[Any, bool]] = []
    exclusive = s.get("exclusiveMinimum")
    if "minimum" in s:
        out.append((_number_value(s, "minimum", path), exclusive is True))
    if "exclusiveMinimum" in s and not isinstance(exclusive, bool):
        out.append((_number_value(s, "exclusiveMinimum", path), True))
    return out


def _upper_bounds(s: Mapping[str, Any], path: str) -> list[tuple[Any, bool]]:
    out: list[tuple[Any, bool]] = []
    exclusive = s.get("exclusiveMaximum")
    if "maximum" in s:
        out.append((_number_value(s, "maximum", path), exclusive is True))
    if "exclusiveMaximum" in s and not isinstance(exclusive, bool):
        out.append((_number_value(s, "exclusiveMaximum", path), True))
    return out


def _required(s: Mapping[str, Any], path: str) -> list[str]:
    names = _list(s, "required", path)
    if not all(type(n) is str for n in names):
        raise InvalidSchema(f"{path}/required", "must be an array of strings")
    return names


def _dependent_required(s: Mapping[str, Any], path: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key in ("dependentRequired", "dependencies"):
        for name, needed in _mapping(s, key, path).items():
            if isinstance(needed, list):  # (draft 7 "dependencies" may also hold schemas)
                if not all(type(n) is str for n in needed):
                    raise InvalidSchema(f"{path}/{key}/{name}", "must be an array of strings")
                out.setdefault(name, []).extend(needed)
    return out


def _array_shape(s: Mapping[str, Any], path: str) -> tuple[list[Any], Any, str]:
    """(the positional schemas, the schema of the items after them or None, its key)."""
    items = s.get("items")
    if "prefixItems" in s:
        return _list(s, "prefixItems", path), items, "items"
    if isinstance(items, list):  # draft 4-2019: positional "items", then "additionalItems"
        return items, s.get("additionalItems"), "additionalItems"
    return [], items, "items"
