"""``/v1/embeddings``: the request, the vectors and the response body.

Rule 1: each input is one prefill-only request for the engine (its prompt, ``max_tokens``
        1: one prefill pass); ``usage`` counts the inputs' prompt tokens (by the model's
        tokenizer, or the byte rule; token ids count exactly).
Rule 2: a vector is a deterministic unit vector per (server seed, model, input): drawn
        from a normal generator seeded by a hash of them, in float32. ``dimensions``
        keeps its first components, scaled back to unit length, so shorter vectors are
        prefixes of longer ones up to scale (as Matryoshka embeddings are).
Rule 3: ``encoding_format`` ``float`` gives JSON numbers (8 decimals), ``base64`` the
        float32 little-endian bytes in base64, which the ``openai`` SDK decodes.
Rule 4: one request holds at most :data:`MAX_INPUTS` inputs and
        :data:`MAX_EMBEDDING_VALUES` values in all; the body is built one vector at a time
        (:func:`embedding_pieces`).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import attrs
import numpy as np

from inference_lab.api.requests import BYTE_TOKENIZER
from inference_lab.api.schema import MAX_INT32, invalid_value
from inference_lab.api.tokenizer import Tokenizer
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.jsonbytes import dumps

__all__ = [
    "MAX_EMBEDDING_VALUES",
    "MAX_INPUTS",
    "EmbeddingsRequest",
    "embedding_pieces",
    "embedding_vector",
    "parse_embeddings_request",
]

#: Inputs in one request at most (OpenAI's bound).
MAX_INPUTS = 2048
#: Values (inputs x dimensions) one request may ask for: about 32 MiB of base64.
MAX_EMBEDDING_VALUES = 1 << 23


@attrs.frozen(kw_only=True)
class EmbeddingsRequest:
    """A validated ``/v1/embeddings`` body: each input's prompt tokens and the bytes
    that seed its vector."""

    model: str
    tokens: tuple[int, ...]
    keys: tuple[bytes, ...]
    dimensions: int | None
    encoding_format: Literal["float", "base64"]
    priority: int


def _is_ids(value: Any) -> bool:
    return type(value) is list and all(type(t) is int and t >= 0 for t in value)


def parse_embeddings_request(
    raw: Mapping[str, Any], *, tokenizer: Tokenizer | None = None
) -> EmbeddingsRequest:
    """Validate a ``/v1/embeddings`` body and count each input (Rule 1); raises
    :class:`ApiError` (400) naming the field."""
    model = raw.get("model")
    if type(model) is not str:
        raise invalid_value("model", "model is required (a string)")
    value = raw.get("input")
    expect = "a string, an array of strings, an array of token ids or an array of token-id arrays"
    inputs: list[str | list[int]]
    if type(value) is str:
        inputs = [value]
    elif _is_ids(value) and value:
        inputs = [value]
    elif (
        type(value) is list
        and value
        and (all(type(v) is str for v in value) or all(_is_ids(v) for v in value))
    ):
        inputs = list(value)
    else:
        raise invalid_value("input", f"input must be {expect} (non-empty)")
    if len(inputs) > MAX_INPUTS:
        raise invalid_value("input", f"input holds {len(inputs):,} items, more than {MAX_INPUTS:,}")
    tok = tokenizer if tokenizer is not None else BYTE_TOKENIZER
    tokens: list[int] = []
    keys: list[bytes] = []
    for i, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 and type(value) is not list else f"input[{i}]"
        if not item:
            raise invalid_value(where, f"{where} must not be empty")
        if type(item) is str:
            tokens.append(tok.count(item, add_special_tokens=True))
            keys.append(b"text\x00" + item.encode("utf-8", "surrogatepass"))
        else:
            tokens.append(len(item))
            keys.append(b"ids\x00" + ",".join(map(str, item)).encode())
    dimensions = raw.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or not 1 <= dimensions <= MAX_INT32):
        raise invalid_value(
            "dimensions", f"dimensions must be an integer >= 1, got {_short(dimensions)}"
        )
    fmt = raw.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid_value(
            "encoding_format", f"encoding_format must be 'float' or 'base64', got {_short(fmt)}"
        )
    priority = raw.get("priority", 0)
    if type(priority) is not int or abs(priority) > MAX_INT32:
        raise invalid_value("priority", "priority must be an integer")
    return EmbeddingsRequest(
        model=model,
        tokens=tuple(tokens),
        keys=tuple(keys),
        dimensions=dimensions,
        encoding_format=fmt,
        priority=priority,
    )


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return truncate_echo(text if len(text) <= 60 else text[:57] + "...")


def check_dimensions(request: EmbeddingsRequest, model_dim: int) -> int:
    """The vectors' length: ``dimensions`` (at most the model's ``model_dim``) or
    ``model_dim``; raises :class:`ApiError` 400 past the model or Rule 4's bound."""
    dim = request.dimensions if request.dimensions is not None else model_dim
    if dim > model_dim:
        raise invalid_value(
            "dimensions", f"dimensions must be at most {model_dim} for model {request.model!r}"
        )
    values = dim * len(request.tokens)
    if values > MAX_EMBEDDING_VALUES:
        raise ApiError(
            400,
            "invalid_value",
            f"{len(request.tokens):,} inputs x {dim:,} dimensions = {values:,} values, more than "
            f"this server's {MAX_EMBEDDING_VALUES:,} per request: send fewer inputs",
            "input",
        )
    return dim


def embedding_vector(seed: int, model: str, key: bytes, dim: int) -> Any:
    """The unit vector of one input (Rule 2), float32, of ``dim`` components: the first
    ``dim`` draws of the input's generator (a prefix of any longer draw), normalised."""
    digest = hashlib.sha256(b"%d\x00" % seed + model.encode() + b"\x00" + key).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:16], "little"))
    head = rng.standard_normal(dim)
    norm = float(np.linalg.norm(head))
    if norm == 0.0:  # (a zero draw: not in practice)
        head = np.ones(dim)
        norm = float(np.sqrt(dim))
    return (head / norm).astype(np.float32)


def encode_vector(vector: Any, fmt: str) -> bytes:
    """One vector as the JSON value ``embedding`` holds (Rule 3)."""
    if fmt == "base64":
        raw = np.asarray(vector, dtype="<f4").tobytes()
        return b'"' + base64.b64encode(raw) + b'"'
    return dumps(np.round(vector.astype(np.float64), 8).tolist())


def embedding_pieces(request: EmbeddingsRequest, seed: int, dim: int) -> Iterator[bytes]:
    """The response body in pieces, one vector each (Rule 4); they concatenate to the
    whole ``list`` object."""
    yield b'{"object":"list","data":['
    for index, key in enumerate(request.keys):
        vector = embedding_vector(seed, request.model, key, dim)
        lead = b"," if index else b""
        yield (
            lead
            + b'{"object":"embedding","index":%d,"embedding":' % index
            + encode_vector(vector, request.encoding_format)
            + b"}"
        )
    prompt = sum(request.tokens)
    usage = {"prompt_tokens": prompt, "total_tokens": prompt}
    yield b'],"model":' + dumps(request.model) + b',"usage":' + dumps(usage) + b"}"
