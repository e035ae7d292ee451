"""Instances of a JSON Schema: the arguments of generated tool calls, structured outputs.

No model runs, so a tool call's ``arguments`` and a ``json_schema`` answer are built from
the schema itself: a value of the right type for every keyword the schema uses (types,
``enum`` / ``const``, ``properties`` / ``required`` / ``additionalProperties`` /
``patternProperties``, ``items`` / ``prefixItems`` / ``contains``, ``minimum`` /
``maximum`` / ``exclusive*`` / ``multipleOf``, ``minLength`` / ``maxLength`` /
``pattern`` / ``format``, ``minItems`` / ``maxItems`` / ``uniqueItems``,
``minProperties`` / ``maxProperties``, ``dependentRequired``, local ``$ref`` /
``$defs``, ``allOf`` / ``anyOf`` / ``oneOf`` / ``not`` / ``if``-``then``-``else``). Text
is placeholder words; every choice comes from the caller's generator. Validation is
:mod:`inference_lab.generate.validator`'s, scalars :mod:`inference_lab.generate.instance_scalars`'.

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
        :class:`InvalidSchema`. All are :class:`SchemaError`.
Rule 3: the work is bounded whatever the schema: :data:`MAX_DEPTH` levels of nesting,
        :data:`MAX_NODES` values in one instance, and every value tried, schema expanded,
        enum entry read and pattern step spent from one
        :class:`~inference_lab.generate.budget.Budget`, with the instance's bytes counted
        before they are built (a ``minLength`` past what is left is refused before one
        character is made). Past the budget the schema is :class:`TooExpensive` at the
        path being generated. Past :data:`SOFT_DEPTH`, optional properties are left out
        and arrays hold their minimum, so recursive schemas end.
Rule 4: the budget's ``inline`` and ``cancelled`` exhaustion
        (:class:`~inference_lab.generate.budget.OutOfWork`) leaves :func:`generate_instance`
        as it is: the caller moves the work to a thread, or has abandoned it.
Rule 5: an error kept to be raised later is kept without its traceback: its frames would
        hold it in a reference cycle, and with it the schema (the request's body) until
        the cyclic collector runs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from inference_lab.generate import instance_scalars
from inference_lab.generate.budget import Budget, OutOfWork
from inference_lab.generate.instance_objects import NameChooser
from inference_lab.generate.patterns import PatternError, pattern_string
from inference_lab.generate.validator import (
    MAX_DEPTH,
    TYPES,
    InvalidSchema,
    Patterns,
    SchemaError,
    Schemas,
    TooExpensive,
    Unsatisfiable,
    Validator,
    _array_shape,
    _count,
    _dependent_required,
    _list,
    _mapping,
    _required,
    _types,
    is_valid,
    value_key,
)
from inference_lab.generate.vocabulary import VOCABULARY

__all__ = [
    "InvalidSchema",
    "MAX_DEPTH",
    "SchemaError",
    "TooExpensive",
    "Unsatisfiable",
    "generate_instance",
    "is_valid",
]

#: Past this depth, optional properties are left out and arrays hold their minimum.
SOFT_DEPTH = 4
#: Values in one instance.
MAX_NODES = 5_000
#: Fresh generations tried before a schema counts as unsatisfiable (Rule 1).
ATTEMPTS = 4
#: Work units of one value tried, and of a placeholder text (about a regex step's time
#: each).
VALUE_UNITS = 4
WORDS_UNITS = 8

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
_WORDS = VOCABULARY


def too_expensive(exc: OutOfWork, budget: Budget) -> TooExpensive:
    """The 400's reason for a spent budget (Rule 3): which bound, at which path."""
    if exc.what == "bytes":
        reason = (
            f"its instances run past the {budget.bytes_limit:,} bytes of JSON this request "
            "may generate"
        )
    else:
        reason = (
            "generating an instance here takes more than this server's work budget "
            f"({budget.limit:,} steps: a pattern, an enum or a list of properties too large)"
        )
    return TooExpensive(exc.path or "", exc.detail or reason)


def generate_instance(schema: Any, rng: random.Random, budget: Budget | None = None) -> Any:
    """An instance of ``schema`` (a JSON Schema as parsed JSON), drawn with ``rng``,
    spending ``budget`` (default: a whole request's). Raises :class:`Unsatisfiable`,
    :class:`InvalidSchema` or :class:`TooExpensive` (Rules 1-3); ``OutOfWork`` for an
    inline or cancelled budget (Rule 4)."""
    spend = Budget() if budget is None else budget
    validator = Validator(Schemas(schema, spend), Patterns(spend))
    last: SchemaError | None = None
    try:
        for _ in range(ATTEMPTS):
            gen = _Generator(validator, rng)
            mark = spend.bytes_spent
            try:
                value = gen.value(gen.expand(schema, "", 0), "", 0)
            except Unsatisfiable as exc:
                last = exc.with_traceback(None)  # (another attempt draws differently)
                spend.bytes_spent = mark
                continue
            if validator.valid(schema, value, "", 0):
                return value
            spend.bytes_spent = mark
            last = Unsatisfiable("", "no instance found that satisfies every keyword")
    except OutOfWork as exc:
        if exc.what not in ("work", "bytes"):
            raise
        raise too_expensive(exc, spend) from None
    assert last is not None
    raise last


def _json_size(value: Any) -> int:
    """About the bytes of ``value`` as compact JSON (strings without their escapes)."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, list):
        return 2 + sum(_json_size(v) + 1 for v in value)
    if isinstance(value, dict):
        return 2 + sum(len(k) + 4 + _json_size(v) for k, v in value.items())
    return len(str(value))


class _Generator:
    """One attempt at an instance (Rules 1-3): its draws, its values and its bytes."""

    def __init__(self, validator: Validator, rng: random.Random) -> None:
        self.schemas = validator.schemas
        self.validator = validator
        self.budget = validator.budget
        self.rng = rng
        self.nodes = 0

    # -- the conjunction at one place ----------------------------------------------------
    def expand(self, schema: Any, path: str, depth: int) -> list[dict[str, Any]]:
        """The schemas that all apply where ``schema`` does: ``$ref`` and ``allOf``
        resolved into the list, ``true`` dropped; ``false`` is unsatisfiable."""
        out: list[dict[str, Any]] = []
        try:
            self._expand(schema, path, depth, out)
        except OutOfWork as exc:
            raise exc.at(path) from None
        return out

    def _expand(self, schema: Any, path: str, depth: int, out: list[dict[str, Any]]) -> None:
        self.budget.spend()
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

    # -- one value -----------------------------------------------------------------------
    def value(self, conj: list[dict[str, Any]], path: str, depth: int) -> Any:
        """A value satisfying ``conj`` at ``path``; work past the budget is named here
        unless a deeper place named it."""
        try:
            return self._value(conj, path, depth)
        except OutOfWork as exc:
            raise exc.at(path) from None

    def _value(self, conj: list[dict[str, Any]], path: str, depth: int) -> Any:
        self.budget.spend(VALUE_UNITS)
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
            chosen = self.rng.choice(candidates)
            self.budget.spend_bytes(_json_size(chosen))
            return self._node(chosen)
        types = self._allowed_types(conj, path)
        errors: list[Unsatisfiable] = []
        for name in types:
            mark = self.budget.bytes_spent
            try:
                return self._node(self._typed(name, conj, path, depth))
            except Unsatisfiable as exc:
                self.budget.bytes_spent = mark  # (what the failed type built is dropped)
                errors.append(exc.with_traceback(None))
        raise errors[0]

    def _node(self, value: Any) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise Unsatisfiable("", f"every instance holds more than {MAX_NODES:,} values")
        return value

    def _attempt(self, conj: list[dict[str, Any]], path: str, depth: int) -> Any:
        """:meth:`value`, with the bytes it built given back when it fails."""
        mark = self.budget.bytes_spent
        try:
            return self.value(conj, path, depth)
        except Unsatisfiable:
            self.budget.bytes_spent = mark
            raise

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
                mark = self.budget.bytes_spent
                try:
                    value = self._attempt(
                        [*rest, *self.expand(branches[i], where, depth)], path, depth
                    )
                except Unsatisfiable as exc:
                    first = first or exc.with_traceback(None).with_traceback(None)
                    break
                if key == "anyOf" or not any(
                    self.validator.valid(b, value, where, 0)
                    for j, b in enumerate(branches)
                    if j != i
                ):
                    return value
                self.budget.bytes_spent = mark
        if first is not None:
            raise first
        raise Unsatisfiable(f"{path}/{key}", "no value matches exactly one branch")

    def _not(self, conj: list[dict[str, Any]], index: int, path: str, depth: int) -> Any:
        s = conj[index]
        rest = [*conj[:index], {k: v for k, v in s.items() if k != "not"}, *conj[index + 1 :]]
        for _ in range(4):
            mark = self.budget.bytes_spent
            value = self.value(rest, path, depth)
            if not self.validator.valid(s["not"], value, f"{path}/not", 0):
                return value
            self.budget.bytes_spent = mark
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
            mark = self.budget.bytes_spent
            try:
                value = self._attempt([*rest, *extra], path, depth)
            except Unsatisfiable as exc:
                first = first or exc.with_traceback(None)
                continue
            if self.validator.valid(condition, value, f"{path}/if", 0) == holds:
                return value
            self.budget.bytes_spent = mark
        raise first or Unsatisfiable(path, "neither branch of if / then / else can be satisfied")

    def _enumerated(self, conj: list[dict[str, Any]], path: str) -> list[Any] | None:
        """The values ``enum`` / ``const`` allow that satisfy the whole conjunction (None
        when neither keyword applies); each entry's key is computed once (validator
        Rule 3), so an enum costs what it holds."""
        pools: list[list[Any]] = []
        for s in conj:
            if "const" in s:
                pools.append([s["const"]])
            if "enum" in s:
                pools.append(_list(s, "enum", path))
        if not pools:
            return None
        others = [self.validator.enum_keys(pool) for pool in pools[1:]]
        out = []
        for value in pools[0]:
            key = self.validator.schema_key(value)
            if all(key in keys for keys in others) and self._matches_all(conj, value, path):
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
        ordered = [t for t in TYPES if t in allowed and t != "null"]
        self.rng.shuffle(ordered)
        if "null" in allowed:
            ordered.append("null")  # a typed value says more than a null
        return ordered

    def _typed(self, name: str, conj: list[dict[str, Any]], path: str, depth: int) -> Any:
        if name == "null":
            self.budget.spend_bytes(4)
            return None
        if name == "boolean":
            self.budget.spend_bytes(5)
            return self.rng.random() < 0.5
        if name == "string":
            return self._string(conj, path)
        if name in ("number", "integer"):
            value = instance_scalars.number(conj, path, name == "integer", self.rng)
            self.budget.spend_bytes(len(str(value)))
            return value
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
        patterns = self.validator.patterns
        compiled = [patterns.at(s["pattern"], f"{path}/pattern") for s in conj if "pattern" in s]
        try:
            self.budget.spend_bytes(lo + 2)  # before a character is made (Rule 3)
        except OutOfWork as exc:
            raise exc.at(f"{path}/minLength") from None
        text = self._text(compiled, lo, hi, conj, path)
        self.budget.spend_bytes(len(text) - lo)
        return text

    def _text(
        self, compiled: list[Any], lo: int, hi: int | None, conj: list[dict[str, Any]], path: str
    ) -> str:
        if compiled:
            where = f"{path}/pattern"
            for _ in range(8):
                try:
                    text = pattern_string(
                        compiled[0], self.rng, min_length=lo, max_length=hi, budget=self.budget
                    )
                except PatternError as exc:
                    raise Unsatisfiable(where, str(exc)) from None
                except OutOfWork as exc:
                    raise exc.at(where) from None
                if all(self.validator.search(c, text, where) for c in compiled[1:]):
                    return text
            raise Unsatisfiable(where, "no string found matching every pattern")
        fmt = next((s["format"] for s in conj if type(s.get("format")) is str), None)
        if fmt is not None:
            formatted = instance_scalars.formatted(fmt, self.rng)
            if (
                formatted is not None
                and lo <= len(formatted)
                and (hi is None or len(formatted) <= hi)
            ):
                return formatted
        self.budget.spend(WORDS_UNITS + lo // 8)  # (a draw per word)
        return instance_scalars.words(lo, hi, self.rng)

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
        if lo > MAX_NODES:  # (refused before one item is built)
            raise Unsatisfiable(
                f"{path}/minItems", f"every instance holds more than {MAX_NODES:,} values"
            )
        unique = any(s.get("uniqueItems") is True for s in conj)
        if depth >= SOFT_DEPTH:
            length = lo
        else:
            top = lo + 3 if hi is None else min(hi, lo + 3)
            length = self.rng.randint(max(lo, min(1, top)), top)
        self.budget.spend_bytes(2)
        items: list[Any] = []
        keys: set[Any] = set()
        for i in range(length):
            where = f"{path}/{i}"
            schemas = self._item_schemas(shapes, contains if i < need else [], i, path, depth)
            for _attempt in range(8):
                mark = self.budget.bytes_spent
                item = self.value(schemas, where, depth + 1)
                key = value_key(item, self.budget) if unique else None
                if key not in keys:
                    break
                self.budget.bytes_spent = mark
            else:
                if len(items) >= lo:
                    break  # shorter, and still long enough
                raise Unsatisfiable(path, "uniqueItems: not enough distinct items")
            if unique:
                keys.add(key)
            self.budget.spend_bytes(1)
            items.append(item)
        return items

    def _item_schemas(
        self,
        shapes: list[tuple[list[Any], Any, str]],
        contains: list[Any],
        i: int,
        path: str,
        depth: int,
    ) -> list[dict[str, Any]]:
        """The schemas item ``i`` of an array must satisfy: each conjunct's prefix item or
        its rest, then ``contains`` (given for the items that must match it), expanded."""
        where = f"{path}/{i}"
        schemas: list[dict[str, Any]] = []
        for prefix, rest, _key in shapes:
            sub = prefix[i] if i < len(prefix) else rest
            if sub is not None:
                schemas.extend(self.expand(sub, where, depth + 1))
        for c in contains:
            schemas.extend(self.expand(c, f"{path}/contains", depth + 1))
        return schemas

    # -- objects -------------------------------------------------------------------------
    def _object(self, conj: list[dict[str, Any]], path: str, depth: int) -> dict[str, Any]:
        declared = list(dict.fromkeys(n for s in conj for n in _mapping(s, "properties", path)))
        required = list(dict.fromkeys(n for s in conj for n in _required(s, path)))
        if len(required) > MAX_NODES:  # (refused before one is checked)
            raise Unsatisfiable(
                f"{path}/required",
                f"{len(required):,} properties are required; an instance holds at most "
                f"{MAX_NODES:,} values",
            )
        self.budget.spend(len(declared) + len(required))
        dependents: dict[str, list[str]] = {}
        for s in conj:
            for name, needed in _dependent_required(s, path).items():
                dependents.setdefault(name, []).extend(needed)
        lo = max((_count(s, "minProperties", path, 0) for s in conj), default=0)
        if lo > MAX_NODES:
            raise Unsatisfiable(
                f"{path}/minProperties", f"every instance holds more than {MAX_NODES:,} values"
            )
        chooser = NameChooser(self.validator, self.rng)
        ordered, must = chooser.choose(
            conj, path, depth >= SOFT_DEPTH, declared, required, dependents, lo
        )
        self.budget.spend_bytes(2)
        out: dict[str, Any] = {}
        for name in ordered:
            where = f"{path}/properties/{name}"
            schemas = self._property_schemas(conj, name, where, depth)
            self.budget.spend_bytes(len(name) + 4)
            try:
                out[name] = self._attempt(schemas, where, depth + 1)
            except Unsatisfiable:
                if name in must:
                    raise
                self.budget.bytes_spent -= len(name) + 4
                continue  # an optional property no value satisfies is left out
        if any(name not in out for name in must) or len(out) < lo:
            raise Unsatisfiable(path, f"minProperties {lo}: not enough properties can be satisfied")
        return out

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
            for regex, sub in self.validator.pattern_properties(s, where):
                if self.validator.search(regex, name, f"{where}/patternProperties"):
                    matched = True
                    out.extend(self.expand(sub, where, depth + 1))
            if not matched and "additionalProperties" in s:
                out.extend(self.expand(s["additionalProperties"], where, depth + 1))
        return out
