"""Instances of a JSON Schema: the arguments of generated tool calls, structured outputs.

No model runs, so a tool call's ``arguments`` and a ``json_schema`` answer are built from
the schema itself: a value of the right type for every keyword the schema uses (types,
``enum`` / ``const``, ``properties`` / ``required`` / ``additionalProperties`` /
``patternProperties``, ``items`` / ``prefixItems`` / ``contains``, ``minimum`` /
``maximum`` / ``exclusive*`` / ``multipleOf``, ``minLength`` / ``maxLength`` /
``pattern`` / ``format``, ``minItems`` / ``maxItems`` / ``uniqueItems``,
``minProperties`` / ``maxProperties``, ``dependentRequired``, local ``$ref`` /
``$defs``, ``allOf`` / ``anyOf`` / ``oneOf`` / ``not`` / ``if``-``then``-``else``). Text
is placeholder words; every choice comes from the caller's generator.

A schema at one place is kept as the list of the schemas that all apply there (a
conjunction): ``allOf`` and ``$ref`` add to the list, and each keyword is read across it,
so ``additionalProperties`` keeps the meaning each schema gives it.

Rule 1: an instance is returned only when :func:`is_valid` accepts it against the whole
        schema; a generation that fails that check is retried with the generator's next
        draws, and a schema that still yields none is :class:`Unsatisfiable`.
Rule 2: a schema no instance can satisfy (contradictory bounds, an empty ``enum``, a
        required property that is forbidden, ``false``) raises :class:`Unsatisfiable`
        naming the path of the contradiction; a malformed one (a keyword of the wrong
        type, a ``$ref`` that does not resolve, a pattern that does not compile) raises
        :class:`InvalidSchema`. Both are :class:`SchemaError`.
Rule 3: the work is bounded whatever the schema: :data:`MAX_DEPTH` levels of nesting,
        :data:`MAX_STEPS` values tried (backtracking included), :data:`MAX_NODES` values
        in one instance. Past :data:`SOFT_DEPTH`, optional properties are left out and
        arrays hold their minimum, so recursive schemas end.
Rule 4: :func:`is_valid` follows JSON Schema 2020-12 for the keywords above (draft 4-7
        spellings too: boolean ``exclusiveMinimum``, array ``items`` with
        ``additionalItems``, ``definitions``, ``dependencies``); ``format`` is an
        annotation there, as in the specification's default. Unknown keywords are
        ignored.
"""

from __future__ import annotations

import math
import random
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any
from urllib.parse import unquote

from inference_lab.generate.patterns import PatternError, compile_pattern, pattern_string
from inference_lab.generate.vocabulary import VOCABULARY

__all__ = [
    "InvalidSchema",
    "MAX_DEPTH",
    "SchemaError",
    "Unsatisfiable",
    "generate_instance",
    "is_valid",
]

#: Nesting deeper than this in every instance is :class:`Unsatisfiable` (Rule 3).
MAX_DEPTH = 16
#: Past this depth, optional properties are left out and arrays hold their minimum.
SOFT_DEPTH = 4
#: Values tried while generating one instance, failed branches included.
MAX_STEPS = 20_000
#: Values in one instance.
MAX_NODES = 5_000
#: Fresh generations tried before a schema counts as unsatisfiable (Rule 1).
ATTEMPTS = 4

_TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")
_OBJECT_KEYWORDS = (
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "minProperties",
    "maxProperties",
    "propertyNames",
    "dependentRequired",
)
_ARRAY_KEYWORDS = ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains")
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


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
    """No instance satisfies the schema (Rule 2), or none was found within the bounds of
    Rule 3."""


class _OutOfSteps(Exception):
    pass


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


def json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values: ``1 == 1.0``, ``true != 1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


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
# references


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


class _Schemas:
    """The root schema and its local references."""

    def __init__(self, root: Any) -> None:
        self.root = root

    def resolve(self, ref: Any, path: str) -> Any:
        if type(ref) is not str:
            raise InvalidSchema(path, "$ref must be a string")
        try:
            return _pointer(self.root, ref)
        except (KeyError, IndexError, ValueError, TypeError):
            if not ref.startswith("#"):
                raise InvalidSchema(
                    path, f"$ref {ref!r}: only local references ('#/...') are supported"
                ) from None
            raise InvalidSchema(path, f"$ref {ref!r} does not resolve") from None


# ---------------------------------------------------------------------------------------
# validation (Rule 4)


def is_valid(schema: Any, value: Any, root: Any = None) -> bool:
    """Whether ``value`` is valid against ``schema`` (local references resolve against
    ``root``, default ``schema``). A malformed schema raises :class:`InvalidSchema`."""
    return _Validator(_Schemas(schema if root is None else root)).valid(schema, value, "", 0)


class _Validator:
    def __init__(self, schemas: _Schemas) -> None:
        self.schemas = schemas

    def valid(self, schema: Any, value: Any, path: str, depth: int) -> bool:
        if schema is True:
            return True
        if schema is False:
            return False
        if not isinstance(schema, dict):
            raise InvalidSchema(path, "a schema must be an object or a boolean")
        if depth > 4 * MAX_DEPTH:
            raise InvalidSchema(path, "$ref cycles without consuming the instance")
        s = schema
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
        types = _types(s, path)
        if types is not None and not any(_type_of(value, t) for t in types):
            return False
        if "const" in s and not json_equal(s["const"], value):
            return False
        if "enum" in s and not any(json_equal(e, value) for e in _list(s, "enum", path)):
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
            return bool(_compiled(s, path).search(value))
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
            for i in range(n):
                for j in range(i):
                    if json_equal(value[i], value[j]):
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
        for name in _required(s, path):
            if name not in value:
                return False
        for name, needed in _dependent_required(s, path).items():
            if name in value and any(d not in value for d in needed):
                return False
        properties = _mapping(s, "properties", path)
        patterns = _pattern_properties(s, path)
        for name, item in value.items():
            if "propertyNames" in s and not self.valid(
                s["propertyNames"], name, f"{path}/propertyNames", depth + 1
            ):
                return False
            matched = False
            if name in properties:
                matched = True
                if not self.valid(properties[name], item, f"{path}/properties", depth + 1):
                    return False
            for compiled, sub in patterns:
                if compiled.search(name):
                    matched = True
                    if not self.valid(sub, item, f"{path}/patternProperties", depth + 1):
                        return False
            if not matched and "additionalProperties" in s:
                extra = s["additionalProperties"]
                if not self.valid(extra, item, f"{path}/additionalProperties", depth + 1):
                    return False
        return True


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
        if name not in _TYPES:
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


def _compiled(s: Mapping[str, Any], path: str) -> re.Pattern[str]:
    pattern = s["pattern"]
    if type(pattern) is not str:
        raise InvalidSchema(f"{path}/pattern", "must be a string")
    try:
        return compile_pattern(pattern)
    except PatternError as exc:
        raise InvalidSchema(f"{path}/pattern", str(exc)) from None


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


def _pattern_properties(s: Mapping[str, Any], path: str) -> list[tuple[re.Pattern[str], Any]]:
    out = []
    for pattern, sub in _mapping(s, "patternProperties", path).items():
        try:
            out.append((compile_pattern(pattern), sub))
        except PatternError as exc:
            raise InvalidSchema(f"{path}/patternProperties", str(exc)) from None
    return out


def _array_shape(s: Mapping[str, Any], path: str) -> tuple[list[Any], Any, str]:
    """(the positional schemas, the schema of the items after them or None, its key)."""
    items = s.get("items")
    if "prefixItems" in s:
        return _list(s, "prefixItems", path), items, "items"
    if isinstance(items, list):  # draft 4-2019: positional "items", then "additionalItems"
        return items, s.get("additionalItems"), "additionalItems"
    return [], items, "items"


# ---------------------------------------------------------------------------------------
# generation


def generate_instance(schema: Any, rng: random.Random) -> Any:
    """An instance of ``schema`` (a JSON Schema as parsed JSON), drawn with ``rng``.
    Raises :class:`Unsatisfiable` or :class:`InvalidSchema` (Rules 1-3)."""
    schemas = _Schemas(schema)
    validator = _Validator(schemas)
    last: SchemaError | None = None
    for _ in range(ATTEMPTS):
        gen = _Generator(schemas, validator, rng)
        try:
            value = gen.value(gen.expand(schema, "", 0), "", 0)
        except _OutOfSteps:
            raise Unsatisfiable(
                "", "no instance found within this server's bounds (the schema is too complex)"
            ) from None
        except Unsatisfiable as exc:
            last = exc  # (another attempt draws differently)
            continue
        if validator.valid(schema, value, "", 0):
            return value
        last = Unsatisfiable("", "no instance found that satisfies every keyword")
    assert last is not None
    raise last


_WORDS = VOCABULARY


class _Generator:
    def __init__(self, schemas: _Schemas, validator: _Validator, rng: random.Random) -> None:
        self.schemas = schemas
        self.validator = validator
        self.rng = rng
        self.steps = 0
        self.nodes = 0

    # -- the conjunction at one place ----------------------------------------------------
    def expand(self, schema: Any, path: str, depth: int) -> list[dict[str, Any]]:
        """The schemas that all apply where ``schema`` does: ``$ref`` and ``allOf``
        resolved into the list, ``true`` dropped; ``false`` is unsatisfiable."""
        out: list[dict[str, Any]] = []
        self._expand(schema, path, depth, out)
        return out

    def _expand(self, schema: Any, path: str, depth: int, out: list[dict[str, Any]]) -> None:
        if schema is True:
            return
        if schema is False:
            raise Unsatisfiable(path, "the schema is false: no value is allowed")
        if not isinstance(schema, dict):
            raise InvalidSchema(path, "a schema must be an object or a boolean")
        if depth > 4 * MAX_DEPTH:
            raise InvalidSchema(path, "$ref cycles without consuming the instance")
        rest = schema
        if "$ref" in schema or "allOf" in schema:
            rest = {k: v for k, v in schema.items() if k not in ("$ref", "allOf")}
            if "$ref" in schema:
                target = self.schemas.resolve(schema["$ref"], path)
                self._expand(target, f"{path}/$ref", depth + 1, out)
            for i, sub in enumerate(_list(schema, "allOf", path)):
                self._expand(sub, f"{path}/allOf/{i}", depth + 1, out)
        out.append(rest)

    def _matches_all(self, conj: Sequence[dict[str, Any]], value: Any, path: str) -> bool:
        return all(self.validator.valid(s, value, path, 0) for s in conj)

    def _step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _OutOfSteps

    # -- one value -----------------------------------------------------------------------
    def value(self, conj: list[dict[str, Any]], path: str, depth: int) -> Any:
        self._step()
        if depth > MAX_DEPTH:
            raise Unsatisfiable(path, f"every instance nests deeper than {MAX_DEPTH} levels")
        for index, s in enumerate(conj):
            for key in ("anyOf", "oneOf"):
                if key in s:
                    return self._choice(conj, index, key, path, depth)
            if "not" in s:
                return self._not(conj, index, path, depth)
            if "if" in s:
                return self._conditional(conj, index, path, depth)
        candidates = self._enumerated(conj, path)
        if candidates is not None:
            if not candidates:
                raise Unsatisfiable(path, "no value of enum / const satisfies the other keywords")
            return self._node(self.rng.choice(candidates))
        types = self._allowed_types(conj, path)
        errors: list[Unsatisfiable] = []
        for name in types:
            try:
                return self._node(self._typed(name, conj, path, depth))
            except Unsatisfiable as exc:
                errors.append(exc)
        raise errors[0]

    def _node(self, value: Any) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise Unsatisfiable("", f"every instance holds more than {MAX_NODES:,} values")
        return value

    def _choice(
        self, conj: list[dict[str, Any]], index: int, key: str, path: str, depth: int
    ) -> Any:
        s = conj[index]
        branches = _list(s, key, path)
        if not branches:
            raise InvalidSchema(f"{path}/{key}", "must be a non-empty array")
        rest = [*conj[:index], {k: v for k, v in s.items() if k != key}, *conj[index + 1 :]]
        order = list(range(len(branches)))
        self.rng.shuffle(order)
        first: Unsatisfiable | None = None
        for i in order:
            where = f"{path}/{key}/{i}"
            for _ in range(3 if key == "oneOf" else 1):  # (a draw may match another branch)
                try:
                    value = self.value(
                        [*rest, *self.expand(branches[i], where, depth)], path, depth
                    )
                except Unsatisfiable as exc:
                    first = first or exc
                    break
                if key == "anyOf" or not any(
                    self.validator.valid(b, value, where, 0)
                    for j, b in enumerate(branches)
                    if j != i
                ):
                    return value
        if first is not None:
            raise first
        raise Unsatisfiable(f"{path}/{key}", "no value matches exactly one branch")

    def _not(self, conj: list[dict[str, Any]], index: int, path: str, depth: int) -> Any:
        s = conj[index]
        rest = [*conj[:index], {k: v for k, v in s.items() if k != "not"}, *conj[index + 1 :]]
        for _ in range(4):
            value = self.value(rest, path, depth)
            if not self.validator.valid(s["not"], value, f"{path}/not", 0):
                return value
        raise Unsatisfiable(f"{path}/not", "every value tried matches the schema of 'not'")

    def _conditional(self, conj: list[dict[str, Any]], index: int, path: str, depth: int) -> Any:
        s = conj[index]
        rest = [
            *conj[:index],
            {k: v for k, v in s.items() if k not in ("if", "then", "else")},
            *conj[index + 1 :],
        ]
        condition = s["if"]
        branches = [(True, s.get("then", True)), (False, s.get("else", True))]
        self.rng.shuffle(branches)
        first: Unsatisfiable | None = None
        for holds, branch in branches:
            extra = self.expand(branch, f"{path}/{'then' if holds else 'else'}", depth)
            if holds:
                extra += self.expand(condition, f"{path}/if", depth)
            try:
                value = self.value([*rest, *extra], path, depth)
            except Unsatisfiable as exc:
                first = first or exc
                continue
            if self.validator.valid(condition, value, f"{path}/if", 0) == holds:
                return value
        raise first or Unsatisfiable(path, "neither branch of if / then / else can be satisfied")

    def _enumerated(self, conj: list[dict[str, Any]], path: str) -> list[Any] | None:
        """The values ``enum`` / ``const`` allow that satisfy the whole conjunction (None
        when neither keyword applies)."""
        pools: list[list[Any]] = []
        for s in conj:
            if "const" in s:
                pools.append([s["const"]])
            if "enum" in s:
                pools.append(_list(s, "enum", path))
        if not pools:
            return None
        out = []
        for value in pools[0]:
            if all(any(json_equal(value, v) for v in pool) for pool in pools[1:]):
                if self._matches_all(conj, value, path):
                    out.append(value)
        return out

    def _allowed_types(self, conj: list[dict[str, Any]], path: str) -> list[str]:
        allowed: set[str] | None = None
        for s in conj:
            names = _types(s, path)
            if names is None:
                continue
            current = set(names)
            if "number" in current:
                current.add("integer")
            allowed = current if allowed is None else allowed & current
        if allowed is None:
            keys = {k for s in conj for k in s}
            inferred = [
                name
                for name, words in (
                    ("object", _OBJECT_KEYWORDS),
                    ("array", _ARRAY_KEYWORDS),
                    ("string", _STRING_KEYWORDS),
                    ("number", _NUMBER_KEYWORDS),
                )
                if keys.intersection(words)
            ]
            return inferred or ["string"]
        if not allowed:
            raise Unsatisfiable(path, "no type satisfies every 'type' that applies here")
        if "number" in allowed:
            allowed.discard("integer")
        ordered = [t for t in _TYPES if t in allowed and t != "null"]
        self.rng.shuffle(ordered)
        if "null" in allowed:
            ordered.append("null")  # a typed value says more than a null
        return ordered

    def _typed(self, name: str, conj: list[dict[str, Any]], path: str, depth: int) -> Any:
        if name == "null":
            return None
        if name == "boolean":
            return self.rng.random() < 0.5
        if name == "string":
            return self._string(conj, path)
        if name in ("number", "integer"):
            return self._number(conj, path, name == "integer")
        if name == "array":
            return self._array(conj, path, depth)
        return self._object(conj, path, depth)

    # -- strings -------------------------------------------------------------------------
    def _string(self, conj: list[dict[str, Any]], path: str) -> str:
        lo = max((_count(s, "minLength", path, 0) for s in conj), default=0)
        hi_values = [_count(s, "maxLength", path, 0) for s in conj if "maxLength" in s]
        hi = min(hi_values) if hi_values else None
        if hi is not None and lo > hi:
            raise Unsatisfiable(path, f"minLength {lo} exceeds maxLength {hi}")
        patterns = [s["pattern"] for s in conj if "pattern" in s]
        for s in conj:
            if "pattern" in s:
                _compiled(s, path)
        if patterns:
            compiled = [compile_pattern(p) for p in patterns[1:]]
            for _ in range(8):
                try:
                    text = pattern_string(patterns[0], self.rng, min_length=lo, max_length=hi)
                except PatternError as exc:
                    raise Unsatisfiable(f"{path}/pattern", str(exc)) from None
                if all(c.search(text) for c in compiled):
                    return text
            raise Unsatisfiable(f"{path}/pattern", "no string found matching every pattern")
        fmt = next((s["format"] for s in conj if type(s.get("format")) is str), None)
        if fmt is not None:
            formatted = _formatted(fmt, self.rng)
            if (
                formatted is not None
                and lo <= len(formatted)
                and (hi is None or len(formatted) <= hi)
            ):
                return formatted
        return self._words(lo, hi)

    def _words(self, lo: int, hi: int | None) -> str:
        rng = self.rng
        if hi is not None and hi < 40:
            target = rng.randint(lo, max(lo, hi))
        else:
            target = max(lo, len(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5)))))
            if hi is not None:
                target = min(target, hi)
        words: list[str] = []
        size = -1
        while size < target:
            word = rng.choice(_WORDS)
            words.append(word)
            size += len(word) + 1
        text = " ".join(words)[:target]
        return text if not text.endswith(" ") else text[:-1] + "s"

    # -- numbers -------------------------------------------------------------------------
    def _number(self, conj: list[dict[str, Any]], path: str, integer: bool) -> int | float:
        lower = [b for s in conj for b in _lower_bounds(s, path)]
        upper = [b for s in conj for b in _upper_bounds(s, path)]
        steps = [_positive_number(s, "multipleOf", path) for s in conj if "multipleOf" in s]
        lo, lo_ex = max(lower, key=lambda b: (b[0], b[1])) if lower else (None, False)
        hi, hi_ex = min(upper, key=lambda b: (b[0], not b[1])) if upper else (None, False)
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_ex or hi_ex))):
            raise Unsatisfiable(path, f"no number lies between the bounds {lo} and {hi}")
        step = Fraction(1) if integer else None
        for m in steps:
            frac = Fraction(str(m))
            step = frac if step is None else _lcm(step, frac)
        if step is not None:
            return self._multiple(step, lo, lo_ex, hi, hi_ex, steps, integer, path)
        low = lo if lo is not None else (hi - 100 if hi is not None else 0)
        high = hi if hi is not None else low + 100
        for _ in range(8):
            value = round(self.rng.uniform(float(low), float(high)), 2)
            if lo is not None and (value < lo or (lo_ex and value == lo)):
                value = (float(low) + float(high)) / 2
            if hi is not None and (value > hi or (hi_ex and value == hi)):
                value = (float(low) + float(high)) / 2
            if (lo is None or value > lo or (not lo_ex and value == lo)) and (
                hi is None or value < hi or (not hi_ex and value == hi)
            ):
                return value
        raise Unsatisfiable(path, f"no number found between the bounds {lo} and {hi}")

    def _multiple(
        self,
        step: Fraction,
        lo: Any,
        lo_ex: bool,
        hi: Any,
        hi_ex: bool,
        steps: list[Any],
        integer: bool,
        path: str,
    ) -> int | float:
        """A multiple of ``step`` within the bounds that every ``multipleOf`` accepts as
        validators compute it (floating point)."""
        k_lo: int | None = None
        if lo is not None:
            ratio = Fraction(lo) / step
            k_lo = math.floor(ratio) + 1 if (lo_ex and ratio.denominator == 1) else math.ceil(ratio)
        k_hi: int | None = None
        if hi is not None:
            ratio = Fraction(hi) / step
            k_hi = math.ceil(ratio) - 1 if (hi_ex and ratio.denominator == 1) else math.floor(ratio)
        if k_lo is None and k_hi is None:
            k_lo = 0
            k_hi = max(1, math.floor(100 / step))
        elif k_lo is None:
            assert k_hi is not None
            k_lo = k_hi - max(1, math.floor(100 / step))
        elif k_hi is None:
            k_hi = k_lo + max(1, math.floor(100 / step))
        if k_lo > k_hi:
            raise Unsatisfiable(path, f"no multiple of {step} lies between the bounds")
        tried: set[int] = set()
        for _ in range(24):
            k = self.rng.randint(k_lo, k_hi)
            if k in tried:
                continue
            tried.add(k)
            exact = k * step
            value: int | float = int(exact) if exact.denominator == 1 else float(exact)
            if integer and not isinstance(value, int):
                continue
            if all(_is_multiple(value, m) for m in steps):
                return value
            if len(tried) > k_hi - k_lo:
                break
        raise Unsatisfiable(path, f"no multiple of {step} found that validates in floating point")

    # -- arrays --------------------------------------------------------------------------
    def _array(self, conj: list[dict[str, Any]], path: str, depth: int) -> list[Any]:
        lo = max((_count(s, "minItems", path, 0) for s in conj), default=0)
        hi_values = [_count(s, "maxItems", path, 0) for s in conj if "maxItems" in s]
        shapes = [_array_shape(s, path) for s in conj]
        for prefix, rest, _key in shapes:
            if rest is False:
                hi_values.append(len(prefix))
        hi = min(hi_values) if hi_values else None
        contains = [s["contains"] for s in conj if "contains" in s]
        need = max((_count(s, "minContains", path, 1) for s in conj if "contains" in s), default=0)
        lo = max(lo, need)
        if hi is not None and lo > hi:
            raise Unsatisfiable(path, f"minItems {lo} exceeds maxItems {hi}")
        unique = any(s.get("uniqueItems") is True for s in conj)
        if depth >= SOFT_DEPTH:
            length = lo
        else:
            top = lo + 3 if hi is None else min(hi, lo + 3)
            length = self.rng.randint(max(lo, min(1, top)), top)
        items: list[Any] = []
        for i in range(length):
            where = f"{path}/{i}"
            schemas: list[dict[str, Any]] = []
            for prefix, rest, _key in shapes:
                sub = prefix[i] if i < len(prefix) else rest
                if sub is not None:
                    schemas.extend(self.expand(sub, where, depth + 1))
            if i < need:
                for c in contains:
                    schemas.extend(self.expand(c, f"{path}/contains", depth + 1))
            for _attempt in range(8):
                item = self.value(schemas, where, depth + 1)
                if not unique or not any(json_equal(item, other) for other in items):
                    break
            else:
                if len(items) >= lo:
                    break  # shorter, and still long enough
                raise Unsatisfiable(path, "uniqueItems: not enough distinct items")
            items.append(item)
        return items

    # -- objects -------------------------------------------------------------------------
    def _object(self, conj: list[dict[str, Any]], path: str, depth: int) -> dict[str, Any]:
        declared: list[str] = []
        for s in conj:
            for name in _mapping(s, "properties", path):
                if name not in declared:
                    declared.append(name)
        required: list[str] = []
        for s in conj:
            for name in _required(s, path):
                if name not in required:
                    required.append(name)
        dependents: dict[str, list[str]] = {}
        for s in conj:
            for name, needed in _dependent_required(s, path).items():
                dependents.setdefault(name, []).extend(needed)
        lo = max((_count(s, "minProperties", path, 0) for s in conj), default=0)
        hi_values = [_count(s, "maxProperties", path, 0) for s in conj if "maxProperties" in s]
        hi = min(hi_values) if hi_values else None
        for name in required:
            if not self._name_allowed(conj, name, path):
                raise Unsatisfiable(
                    f"{path}/required", f"property {name!r} is required but not allowed"
                )
        chosen = list(required)
        soft = depth >= SOFT_DEPTH
        for name in declared:
            if name not in chosen and not soft and self.rng.random() < 0.6:
                if self._name_allowed(conj, name, path):
                    chosen.append(name)
        self._close_dependents(chosen, dependents, conj, path)
        if len(chosen) < lo:
            for name in declared:
                if len(chosen) >= lo:
                    break
                if name not in chosen and self._name_allowed(conj, name, path):
                    chosen.append(name)
                    self._close_dependents(chosen, dependents, conj, path)
            for name in self._extra_names(conj, path, set(chosen)):
                if len(chosen) >= lo:
                    break
                chosen.append(name)
        if len(chosen) < lo:
            raise Unsatisfiable(path, f"minProperties {lo}: not enough properties are allowed")
        if hi is not None and len(chosen) > hi:
            keep = set(required)
            for name in required:
                keep.update(dependents.get(name, ()))
            chosen = [n for n in chosen if n in keep] + [n for n in chosen if n not in keep]
            chosen = chosen[: max(hi, len(keep))]
            if len(chosen) > hi:
                raise Unsatisfiable(
                    path, f"maxProperties {hi} is below the {len(keep)} required properties"
                )
        ordered = [n for n in declared if n in chosen] + [n for n in chosen if n not in declared]
        must = set(required)
        for name in ordered:
            must.update(dependents.get(name, ()))
        out: dict[str, Any] = {}
        for name in ordered:
            where = f"{path}/properties/{name}"
            schemas = self._property_schemas(conj, name, where, depth)
            try:
                out[name] = self.value(schemas, where, depth + 1)
            except Unsatisfiable:
                if name in must:
                    raise
                continue  # an optional property no value satisfies is left out
        if any(name not in out for name in must) or len(out) < lo:
            raise Unsatisfiable(path, f"minProperties {lo}: not enough properties can be satisfied")
        return out

    def _close_dependents(
        self,
        chosen: list[str],
        dependents: dict[str, list[str]],
        conj: list[dict[str, Any]],
        path: str,
    ) -> None:
        i = 0
        while i < len(chosen):
            for needed in dependents.get(chosen[i], ()):
                if needed not in chosen:
                    if not self._name_allowed(conj, needed, path):
                        raise Unsatisfiable(
                            f"{path}/dependentRequired", f"{needed!r} is needed but not allowed"
                        )
                    chosen.append(needed)
            i += 1

    def _name_allowed(self, conj: list[dict[str, Any]], name: str, path: str) -> bool:
        for s in conj:
            if "propertyNames" in s and not self.validator.valid(
                s["propertyNames"], name, f"{path}/propertyNames", 0
            ):
                return False
            if s.get("additionalProperties") is False:
                if name not in _mapping(s, "properties", path) and not any(
                    c.search(name) for c, _ in _pattern_properties(s, path)
                ):
                    return False
        return True

    def _extra_names(self, conj: list[dict[str, Any]], path: str, taken: set[str]) -> Iterator[str]:
        for word in [*_WORDS, *(f"{a}_{b}" for a in _WORDS[:10] for b in _WORDS[:10])]:
            if word not in taken and self._name_allowed(conj, word, path):
                yield word
        for s in conj:
            for pattern in _mapping(s, "patternProperties", path):
                for _ in range(4):
                    try:
                        name = pattern_string(pattern, self.rng)
                    except PatternError:
                        break
                    if name not in taken and self._name_allowed(conj, name, path):
                        taken.add(name)
                        yield name

    def _property_schemas(
        self, conj: list[dict[str, Any]], name: str, where: str, depth: int
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for s in conj:
            properties = _mapping(s, "properties", where)
            matched = False
            if name in properties:
                matched = True
                out.extend(self.expand(properties[name], where, depth + 1))
            for compiled, sub in _pattern_properties(s, where):
                if compiled.search(name):
                    matched = True
                    out.extend(self.expand(sub, where, depth + 1))
            if not matched and "additionalProperties" in s:
                out.extend(self.expand(s["additionalProperties"], where, depth + 1))
        return out


def _lcm(a: Fraction, b: Fraction) -> Fraction:
    """The least common multiple of two positive rationals."""
    num = a.numerator * b.numerator // math.gcd(a.numerator, b.numerator)
    return Fraction(num, math.gcd(a.denominator, b.denominator))


def _formatted(fmt: str, rng: random.Random) -> str | None:
    """A string of the ``format`` (None for a format without a generator here)."""
    year, month, day = rng.randint(2000, 2030), rng.randint(1, 12), rng.randint(1, 28)
    hour, minute, second = rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)
    word = rng.choice(_WORDS)
    other = rng.choice(_WORDS)
    if fmt == "date-time":
        return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}Z"
    if fmt == "date":
        return f"{year:04d}-{month:02d}-{day:02d}"
    if fmt == "time":
        return f"{hour:02d}:{minute:02d}:{second:02d}Z"
    if fmt == "duration":
        return f"P{rng.randint(1, 30)}DT{rng.randint(1, 23)}H"
    if fmt in ("email", "idn-email"):
        return f"{word}.{other}@example.com"
    if fmt in ("hostname", "idn-hostname"):
        return f"{word}-{other}.example.com"
    if fmt == "ipv4":
        return f"192.0.2.{rng.randint(1, 254)}"
    if fmt == "ipv6":
        return f"2001:db8::{rng.randint(1, 0xFFFF):x}"
    if fmt in ("uri", "url", "iri", "uri-reference", "iri-reference"):
        return f"https://example.com/{word}/{other}"
    if fmt == "uri-template":
        return f"https://example.com/{{{word}}}"
    if fmt == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if fmt == "json-pointer":
        return f"/{word}/{other}"
    if fmt == "relative-json-pointer":
        return f"0/{word}"
    if fmt == "regex":
        return f"^{word}$"
    return None
