"""JSON Schema instances and regex strings (``generate/instances.py``, ``generate/patterns.py``),
checked by an independent validator (``jsonschema``, a test dependency only).

Random schemas come from :func:`random_schema`, a seeded generator of satisfiable schemas
using every keyword the server generates for; each test states what it guards."""

from __future__ import annotations

import datetime
import json
import random
import re
import uuid
from typing import Any, Literal

import jsonschema
import pydantic
import pytest
from openai.lib._pydantic import to_strict_json_schema

from inference_lab.api.agents import (
    AgentRequest,
    FunctionTool,
    StructuredOutput,
    plan_answer,
    split_pieces,
)
from inference_lab.generate.instances import (
    MAX_DEPTH,
    InvalidSchema,
    Unsatisfiable,
    generate_instance,
    is_valid,
)
from inference_lab.generate.patterns import PatternError, pattern_string

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
PATTERNS = [
    r"^[a-z]{3,8}$",
    r"^\d{3}-\d{4}$",
    r"^(foo|bar|baz)_[0-9]+$",
    r"[A-Z][a-z]+",
    r"^\w+@\w+\.com$",
    r"^#[0-9a-fA-F]{6}$",
    r"^[^\s]{2,5}$",
    r"^(ab)+c?$",
    r"^x(?:y|z){2}\.\d$",
]
FORMATS = ["date-time", "date", "time", "email", "uuid", "uri", "ipv4", "ipv6", "hostname"]
VALIDATOR = jsonschema.Draft202012Validator


def validate(schema: Any, instance: Any) -> None:
    """Raise unless ``instance`` is valid against ``schema`` (formats asserted)."""
    VALIDATOR(schema, format_checker=VALIDATOR.FORMAT_CHECKER).validate(instance)


def random_schema(rng: random.Random, depth: int = 0, *, refs: tuple[str, ...] = ()) -> Any:
    """A satisfiable schema drawn with ``rng``."""
    leaf = depth >= 3
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "nullable"]
    kinds += ["pattern", "format", "not"]
    if not leaf:
        kinds += ["object", "object", "array", "array", "anyOf", "oneOf", "allOf", "if"]
        kinds += ["tuple"]
    if refs:
        kinds.append("ref")
    kind = rng.choice(kinds)
    if kind == "string":
        s: dict[str, Any] = {"type": "string"}
        if rng.random() < 0.5:
            lo = rng.randint(0, 6)
            s["minLength"] = lo
            if rng.random() < 0.6:
                s["maxLength"] = lo + rng.randint(0, 20)
        return s
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == "integer":
        s = {"type": "integer"}
        lo = rng.randint(-1000, 1000)
        if rng.random() < 0.5:
            s["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = lo
        if rng.random() < 0.5:
            s["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = lo + rng.randint(60, 500)
        if rng.random() < 0.3:
            s["multipleOf"] = rng.choice([2, 3, 5, 10])
        return s
    if kind == "number":
        s = {"type": "number"}
        lo = round(rng.uniform(-100, 100), 2)
        if rng.random() < 0.5:
            s["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = lo
        if rng.random() < 0.5:
            s["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = lo + rng.uniform(30, 200)
        if rng.random() < 0.3:
            s["multipleOf"] = rng.choice([0.5, 0.25, 0.1, 2.5])
        return s
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        pool: list[Any] = [*rng.sample(WORDS, 3), 1, 2.5, True, None, [1, 2], {"k": "v"}]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice([*WORDS, 7, False, None])}
    if kind == "nullable":
        return {"type": [rng.choice(["string", "integer", "number", "boolean"]), "null"]}
    if kind == "not":
        return {"type": "string", "not": {"enum": ["alpha", "beta"]}}
    if kind == "ref":
        return {"$ref": rng.choice(refs)}
    if kind == "object":
        names = rng.sample(WORDS, rng.randint(0, 5))
        props = {n: random_schema(rng, depth + 1, refs=refs) for n in names}
        s = {"type": "object", "properties": props}
        required = [n for n in names if rng.random() < 0.6]
        if required:
            s["required"] = required
        roll = rng.random()
        if roll < 0.4:
            s["additionalProperties"] = False
        elif roll < 0.5:
            s["additionalProperties"] = {"type": "integer"}
        elif roll < 0.6:
            s["patternProperties"] = {"^x_": {"type": "boolean"}}
        if rng.random() < 0.3 and s.get("additionalProperties") is not False:
            s["minProperties"] = len(required) + rng.randint(0, 2)
        if rng.random() < 0.2:
            s["maxProperties"] = max(len(required), s.get("minProperties", 0)) + rng.randint(0, 2)
        return s
    if kind == "array":
        items = random_schema(rng, depth + 1, refs=refs)
        s = {"type": "array", "items": items}
        lo = rng.randint(0, 3)
        if rng.random() < 0.5:
            s["minItems"] = lo
        if rng.random() < 0.5:
            s["maxItems"] = lo + rng.randint(0, 4)
        if rng.random() < 0.2:
            s["items"] = {"type": "integer", "minimum": 0, "maximum": 10_000}
            s["uniqueItems"] = True
        if rng.random() < 0.1 and s.get("maxItems", 1) >= 1:
            s["contains"] = {"type": "integer", "const": 7}
            s["items"] = {"type": "integer"}
        return s
    if kind == "tuple":
        prefix = [random_schema(rng, depth + 1, refs=refs) for _ in range(rng.randint(1, 3))]
        s = {"type": "array", "prefixItems": prefix, "minItems": len(prefix)}
        if rng.random() < 0.5:
            s["items"] = False
        return s
    if kind == "anyOf":
        return {
            "anyOf": [random_schema(rng, depth + 1, refs=refs) for _ in range(rng.randint(2, 3))]
        }
    if kind == "oneOf":
        types = rng.sample(["string", "integer", "boolean", "null", "array", "object"], 3)
        return {"oneOf": [{"type": t} for t in types]}
    if kind == "allOf":
        if rng.random() < 0.5:
            lo = rng.randint(0, 50)
            return {"allOf": [{"type": "integer", "minimum": lo}, {"maximum": lo + 100}]}
        a, b = rng.sample(WORDS, 2)
        return {
            "allOf": [
                {"type": "object", "properties": {a: {"type": "string"}}, "required": [a]},
                {"properties": {b: {"type": "integer"}}, "required": [b]},
            ]
        }
    # if / then / else
    return {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b"]}, "size": {"type": "integer"}},
        "required": ["kind", "size"],
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"properties": {"size": {"minimum": 100}}},
        "else": {"properties": {"size": {"maximum": -100}}},
    }


def random_root(rng: random.Random) -> Any:
    """A schema with ``$defs`` that its subschemas may reference."""
    defs = {f"D{i}": random_schema(rng, 1) for i in range(rng.randint(0, 2))}
    refs = tuple(f"#/$defs/{name}" for name in defs)
    root = random_schema(rng, 0, refs=refs)
    if defs and isinstance(root, dict):
        root = {**root, "$defs": defs}
    return root


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """An arbitrary JSON value (to check the validator against jsonschema)."""
    kind = rng.randrange(8 if depth < 2 else 5)
    if kind == 0:
        return rng.choice(WORDS + ["", "#a1b2c3", "123-4567", "foo_12", "abab"])
    if kind == 1:
        return rng.randint(-2000, 2000)
    if kind == 2:
        return rng.choice([0.5, 2.5, 0.1, 0.3, -7.25, 100.0, 1e3])
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    names = rng.sample(WORDS + ["x_1", "kind", "size"], rng.randint(0, 4))
    return {n: random_value(rng, depth + 1) for n in names}


def test_1000_random_schemas_give_valid_instances() -> None:
    """Every instance generated for 1,000 random satisfiable schemas is valid for the
    jsonschema library (formats included): 0 invalid."""
    rng = random.Random(20261201)
    invalid = []
    for case in range(1000):
        schema = random_root(rng)
        instance = generate_instance(schema, random.Random(case))
        errors = list(
            VALIDATOR(schema, format_checker=VALIDATOR.FORMAT_CHECKER).iter_errors(instance)
        )
        if errors:
            invalid.append((schema, instance, errors[0].message))
    assert invalid == []


def test_1000_tool_calls_and_structured_outputs_validate() -> None:
    """500 tool-call argument sets (each call's ``arguments`` text) and 500 structured
    outputs (the answer's text), planned as the server plans them for random schemas,
    parse as JSON and validate against their schemas: 0 invalid."""
    rng = random.Random(7)
    checked = 0
    for case in range(500):
        tools = []
        for t in range(rng.randint(1, 3)):
            schema = random_schema(rng, 1)
            properties = {"arg": schema, "other": random_schema(rng, 1)}
            parameters = {"type": "object", "properties": properties, "required": ["arg"]}
            tools.append(FunctionTool(name=f"tool_{t}", parameters=parameters, param="tools"))
        agent = AgentRequest(tools=tuple(tools), tool_choice="required")
        plan = plan_answer(agent, random.Random(case))
        assert plan is not None and plan.calls
        for call in plan.calls:
            tool = next(t for t in tools if t.name == call.name)
            assert "".join(call.pieces) == call.arguments
            validate(tool.parameters, json.loads(call.arguments))
            checked += 1
    for case in range(500):
        schema = random_root(rng)
        output = StructuredOutput(kind="json_schema", param="response_format", schema=schema)
        plan = plan_answer(AgentRequest(output=output), random.Random(case))
        assert plan is not None and plan.text is not None
        validate(schema, json.loads("".join(plan.text)))
        checked += 1
    assert checked >= 1000


def test_the_validator_agrees_with_jsonschema() -> None:
    """``is_valid`` (the generator's own check) decides as jsonschema does for random
    schemas and random values, valid and invalid alike."""
    rng = random.Random(99)
    disagreements = []
    seen_valid = seen_invalid = 0
    for case in range(1500):
        schema = random_root(rng)
        value = random_value(rng) if case % 3 else generate_instance(schema, random.Random(case))
        ours = is_valid(schema, value)
        theirs = VALIDATOR(schema).is_valid(value)
        seen_valid += theirs
        seen_invalid += not theirs
        if ours != theirs:
            disagreements.append((schema, value, ours))
    assert disagreements == []
    assert seen_valid > 300 and seen_invalid > 300  # both sides were exercised


class Address(pydantic.BaseModel):
    street: str
    zip_code: str = pydantic.Field(pattern=r"^\d{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=2, max_length=40)
    age: int = pydantic.Field(ge=0, le=130)
    email: str | None
    kind: Literal["customer", "employee"]
    tags: list[str]
    address: Address
    previous: list[Address]
    born: datetime.date
    seen: datetime.datetime
    id: uuid.UUID
    score: float = pydantic.Field(gt=0, lt=1)


def test_pydantic_strict_schemas_parse_back_into_their_models() -> None:
    """Instances of the strict schema the openai SDK sends for a Pydantic model
    (``$defs``, ``$ref``, ``anyOf`` for optionals, formats, bounds, patterns) parse back
    into the model with Pydantic's own validation."""
    schema = to_strict_json_schema(Person)
    for seed in range(200):
        instance = generate_instance(schema, random.Random(seed))
        validate(schema, instance)
        Person.model_validate_json(json.dumps(instance))


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"type": "integer", "minimum": 5, "maximum": 3}, ""),
        ({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1}, ""),
        ({"type": "string", "minLength": 5, "maxLength": 2}, ""),
        ({"type": "array", "minItems": 3, "maxItems": 1}, ""),
        ({"enum": []}, ""),
        ({"type": "string", "enum": [1, 2]}, ""),
        ({"const": "a", "enum": ["b"]}, ""),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, ""),
        (
            {"type": "object", "properties": {"a": False}, "required": ["a"]},
            "/properties/a",
        ),
        ({"type": "object", "additionalProperties": False, "required": ["x"]}, "/required"),
        ({"type": "object", "maxProperties": 1, "required": ["a", "b"]}, ""),
        ({"type": "integer", "multipleOf": 10, "minimum": 1, "maximum": 9}, ""),
        (
            {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3},
            "",
        ),
        (False, ""),
        (
            {
                "$defs": {
                    "n": {
                        "type": "object",
                        "properties": {"n": {"$ref": "#/$defs/n"}},
                        "required": ["n"],
                    }
                },
                "$ref": "#/$defs/n",
            },
            None,
        ),
    ],
)
def test_contradictory_schemas_are_unsatisfiable(schema: Any, path: str | None) -> None:
    """A schema no instance satisfies raises Unsatisfiable naming where (an infinitely
    nested required property included: it passes the depth bound)."""
    with pytest.raises(Unsatisfiable) as info:
        generate_instance(schema, random.Random(0))
    if path is not None:
        assert info.value.path.startswith(path)
    if schema and isinstance(schema, dict) and "$defs" in schema:
        assert str(MAX_DEPTH) in info.value.reason


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"type": "strng"}, "/type"),
        ({"$ref": "#/$defs/missing"}, ""),
        ({"$ref": "https://example.com/s.json"}, ""),
        ({"type": "string", "pattern": "("}, "/pattern"),
        ({"type": "integer", "minimum": "3"}, "/minimum"),
        ({"type": "object", "required": "a"}, "/required"),
        ({"type": "array", "minItems": -1}, "/minItems"),
        ({"anyOf": []}, "/anyOf"),
        ({"$ref": "#"}, None),
    ],
)
def test_malformed_schemas_are_invalid(schema: Any, path: str | None) -> None:
    """A malformed schema raises InvalidSchema naming the keyword's path."""
    with pytest.raises(InvalidSchema) as info:
        generate_instance(schema, random.Random(0))
    if path is not None:
        assert info.value.path == path


def test_generation_is_a_function_of_the_generator() -> None:
    """The same schema and the same seed give the same instance; other seeds vary it."""
    schema = to_strict_json_schema(Person)
    first = generate_instance(schema, random.Random(5))
    assert generate_instance(schema, random.Random(5)) == first
    assert any(generate_instance(schema, random.Random(s)) != first for s in range(6, 10))


def test_recursive_schemas_end() -> None:
    """A recursive schema with optional recursion yields a finite instance within the
    depth bound."""
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["value", "children"],
            }
        },
        "$ref": "#/$defs/node",
    }
    for seed in range(20):
        validate(tree, generate_instance(tree, random.Random(seed)))


@pytest.mark.parametrize("pattern", PATTERNS + [r"(\w)-\1", r"^[A-Z]{2}(?=\d)\d{2}$", r"a|b|c"])
def test_pattern_strings_match(pattern: str) -> None:
    """Every string generated for a pattern is found by ``re.search`` (back-references
    and look-aheads included: checked, not trusted)."""
    rng = random.Random(1)
    for _ in range(50):
        assert re.search(pattern, pattern_string(pattern, rng))


def test_pattern_strings_respect_length_bounds() -> None:
    """``minLength`` / ``maxLength`` hold for pattern strings; a pattern that cannot meet
    them is a PatternError."""
    rng = random.Random(2)
    for _ in range(50):
        text = pattern_string(r"[a-z]+", rng, min_length=10, max_length=12)
        assert 10 <= len(text) <= 12
    with pytest.raises(PatternError):
        pattern_string(r"^\d{3}$", rng, min_length=5)
    with pytest.raises(PatternError):
        pattern_string(r"^(?!a)a$", rng)


def test_pieces_concatenate_to_the_text() -> None:
    """The token pieces of any text concatenate to it and none is empty: a word with its
    leading space, up to 3 digits, up to 3 other characters."""
    rng = random.Random(3)
    for case in range(300):
        text = json.dumps(
            generate_instance(random_root(rng), random.Random(case)), ensure_ascii=False
        )
        pieces = split_pieces(text)
        assert "".join(pieces) == text
        assert all(pieces)
    sample = json.dumps({"city": "the of and", "days": [1, 2345]}, separators=(",", ":"))
    assert split_pieces(sample) == (
        '{"',
        "city",
        '":"',
        "the",
        " of",
        " and",
        '","',
        "days",
        '":[',
        "1",
        ",",
        "234",
        "5",
        "]}",
    )
    assert "".join(split_pieces("héllo wörld ✓ 12345")) == "héllo wörld ✓ 12345"
