"""vLLM's pooling routes: ``/v1/rerank`` (Cohere / Jina shape), ``/v1/score``,
``/classify`` and ``/pooling`` -- the requests and the response bodies.

Rule 1: each item (a rerank document, a score pair, an input) is one prefill-only request
        for the engine, as an embeddings input is (``api/embeddings.py``). A rerank or
        score pair is the cross-encoder's one sequence: the query's tokens (with the
        tokenizer's special tokens) + the document's (without) + 1 separator.
        ``truncate_prompt_tokens`` (k > 0: keep k tokens; -1: the model's context) caps
        each item, ``max_tokens_per_query`` / ``max_tokens_per_doc`` each side, as vLLM.
Rule 2: a relevance score is deterministic per (server seed, model, query, document):
        sigmoid(6 x coverage - 3 + noise), coverage the fraction of the query's distinct
        words (or token ids) that the document holds, noise a normal draw (sigma 0.5)
        made from a hash of them. A document that shares the query's words ranks above
        one that does not, as a reranker would; the value means nothing more. Pairs are
        scored as the body is built, :data:`SCORE_CHUNK` between two yields.
Rule 3: ``/classify`` gives each input :data:`NUM_CLASSES` labels (``LABEL_0`` ...,
        Hugging Face's default names) with softmax probabilities of seeded logits
        (``use_activation: false``: the logits); ``/pooling`` gives each input's vector
        (the ``/v1/embeddings`` one; ``task: "classify"``: the probabilities).
Rule 4: one request holds at most :data:`MAX_ITEMS` items (a 400 naming the field past
        it): bounded work for any body the size cap lets in.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import attrs
import numpy as np

from inference_lab.api.embeddings import (
    MAX_EMBEDDING_VALUES,
    EmbeddingsRequest,
    embedding_vector,
    encode_vector,
    parse_embeddings_request,
)
from inference_lab.api.encoding import random_hex
from inference_lab.api.requests import BYTE_TOKENIZER
from inference_lab.api.schema import MAX_INT32, invalid_value
from inference_lab.api.tokenizer import Tokenizer
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.jsonbytes import dumps

__all__ = [
    "MAX_ITEMS",
    "NUM_CLASSES",
    "PoolingRequest",
    "check_pooling_dimensions",
    "class_probs",
    "parse_classify_request",
    "parse_pooling_request",
    "parse_rerank_request",
    "parse_score_request",
    "pooling_pieces",
    "relevance",
]

#: Items (documents, pairs, inputs) in one request at most (Rule 4).
MAX_ITEMS = 2048
#: Labels of a ``/classify`` answer (Rule 3).
NUM_CLASSES = 2
#: (first, second) field names of a score request, in vLLM's order of precedence.
SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"))
SCORE_FIELDS_ALL = (*SCORE_FIELDS, ("data_1", "data_2"))

Kind = Literal["rerank", "score", "classify", "pooling"]


@attrs.frozen(kw_only=True)
class PoolingRequest:
    """A validated pooling request: one engine request per item (Rule 1)."""

    kind: Kind
    model: str
    priority: int
    #: Each item's prompt tokens (the engine request's prompt).
    tokens: tuple[int, ...]
    #: Rerank and score: each item's (query, document), scored as the body is built.
    pairs: tuple[tuple[str | list[int], str | list[int]], ...] = ()
    #: Classify and pooling: each input's seed key.
    keys: tuple[bytes, ...] = ()
    #: Rerank: each document's text (or None for token ids); ``top_n`` (0: all).
    documents: tuple[str | None, ...] = ()
    top_n: int = 0
    #: Classify / pooling: activation on; pooling's task, format and vector length.
    activation: bool = True
    task: Literal["embed", "classify"] = "embed"
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    #: The field whose items these are (a too-long item's 400 names it).
    field: str = "input"

    def where(self, index: int) -> str:
        """The field a too-long item is named by in a 400."""
        return self.field if len(self.tokens) == 1 else f"{self.field}[{index}]"


# --------------------------------------------------------------------------- common


def _short(value: Any) -> str:
    text = json.dumps(value)
    return truncate_echo(text if len(text) <= 60 else text[:57] + "...")


def _common(raw: Mapping[str, Any]) -> tuple[str, int, int | None]:
    """``model``, ``priority`` and ``truncate_prompt_tokens`` (None: no cap)."""
    model = raw.get("model")
    if type(model) is not str:
        raise invalid_value("model", "model is required (a string)")
    priority = raw.get("priority", 0)
    if type(priority) is not int or abs(priority) > MAX_INT32:
        raise invalid_value("priority", "priority must be an integer")
    cap = _int_field(raw, "truncate_prompt_tokens", -1)
    return model, priority, cap if cap not in (None, -1) else None


def _int_field(raw: Mapping[str, Any], name: str, low: int) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= MAX_INT32:
        raise invalid_value(name, f"{name} must be an integer >= {low}, got {_short(value)}")
    return value


def _capped(tokens: int, cap: int | None) -> int:
    return tokens if cap is None or cap <= 0 else min(tokens, cap)


def _is_ids(value: Any) -> bool:
    return type(value) is list and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _texts(value: Any, field: str, *, single: bool = False) -> list[str | list[int]]:
    """A score input (a string, token ids, or a list of them) as a list of items."""
    if type(value) is str or _is_ids(value):
        return [value]
    if not single and type(value) is list and value:
        if len(value) > MAX_ITEMS:
            raise invalid_value(
                field, f"{field} holds {len(value):,} items, more than {MAX_ITEMS:,} (Rule 4)"
            )
        items: list[str | list[int]] = []
        for i, item in enumerate(value):
            if type(item) is not str and not _is_ids(item):
                raise invalid_value(
                    f"{field}[{i}]",
                    f"{field}[{i}] must be a string or token ids; only text is served here",
                )
            items.append(item)
        return items
    what = "a string or token ids" + ("" if single else ", or a non-empty list of them")
    raise invalid_value(field, f"{field} must be {what}")


def _words(item: str | list[int]) -> frozenset[str]:
    if type(item) is str:
        return frozenset(re.findall(r"\w+", item.lower()))
    return frozenset(map(str, item))


def _count(tok: Tokenizer, item: str | list[int], special: bool) -> int:
    return tok.count(item, add_special_tokens=special) if type(item) is str else len(item)


def _key(item: str | list[int]) -> bytes:
    if type(item) is str:
        return b"text\x00" + item.encode("utf-8", "surrogatepass")
    return b"ids\x00" + ",".join(map(str, item)).encode()


class _Scorer:
    """Rule 2's score of documents against one query (its words and hash prefix kept)."""

    def __init__(self, seed: int, model: str, query: str | list[int]) -> None:
        self.words = _words(query)
        self.prefix = b"%d\x00" % seed + model.encode() + b"\x00" + _key(query) + b"\x00"

    def score(self, document: str | list[int]) -> float:
        words = self.words
        coverage = len(words & _words(document)) / len(words) if words else 0.0
        digest = hashlib.sha256(self.prefix + _key(document)).digest()
        # a standard normal from the digest's bits (Box-Muller): no generator per pair
        u1 = (int.from_bytes(digest[:8], "little") + 1) / 2.0**64
        u2 = int.from_bytes(digest[8:16], "little") / 2.0**64
        noise = 0.5 * math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        return 1.0 / (1.0 + math.exp(-(6.0 * coverage - 3.0 + noise)))


def relevance(seed: int, model: str, query: str | list[int], document: str | list[int]) -> float:
    """The score of one (query, document) pair (Rule 2)."""
    return _Scorer(seed, model, query).score(document)


def _pairs(
    raw: Mapping[str, Any],
    queries: list[str | list[int]],
    documents: list[str | list[int]],
    tokenizer: Tokenizer | None,
    cap: int | None,
) -> tuple[tuple[int, ...], tuple[tuple[str | list[int], str | list[int]], ...]]:
    """Each pair's prompt tokens (Rule 1) and the pair; ``queries`` is one query or one per
    document."""
    tok = tokenizer if tokenizer is not None else BYTE_TOKENIZER
    per_query = _int_field(raw, "max_tokens_per_query", 0)
    per_doc = _int_field(raw, "max_tokens_per_doc", 0)
    query_tokens = [_capped(_count(tok, q, True), per_query) for q in queries]
    tokens: list[int] = []
    pairs: list[tuple[str | list[int], str | list[int]]] = []
    for i, doc in enumerate(documents):
        q = 0 if len(queries) == 1 else i
        pair = query_tokens[q] + _capped(_count(tok, doc, False), per_doc) + 1
        tokens.append(_capped(pair, cap))
        pairs.append((queries[q], doc))
    return tuple(tokens), tuple(pairs)


# --------------------------------------------------------------------------- parsers


def parse_rerank_request(
    raw: Mapping[str, Any], *, tokenizer: Tokenizer | None = None
) -> PoolingRequest:
    """``/v1/rerank``, ``/rerank``, ``/v2/rerank``: ``query``, ``documents``, ``top_n``;
    raises :class:`ApiError` (400) naming the field."""
    model, priority, cap = _common(raw)
    query = _texts(raw.get("query"), "query", single=True)
    if "documents" not in raw:
        raise invalid_value("documents", "documents is required")
    documents = _texts(raw.get("documents"), "documents")
    top_n = raw.get("top_n", 0)
    if top_n is None:
        top_n = 0
    if type(top_n) is not int or not 0 <= top_n <= MAX_INT32:
        raise invalid_value("top_n", f"top_n must be an integer >= 0, got {_short(top_n)}")
    tokens, pairs = _pairs(raw, query, documents, tokenizer, cap)
    return PoolingRequest(
        kind="rerank",
        model=model,
        priority=priority,
        tokens=tokens,
        pairs=pairs,
        documents=tuple(d if type(d) is str else None for d in documents),
        top_n=top_n,
        field="documents",
    )


def parse_score_request(
    raw: Mapping[str, Any], *, tokenizer: Tokenizer | None = None
) -> PoolingRequest:
    """``/v1/score``, ``/score``: ``text_1`` / ``text_2`` (or ``queries`` with
    ``documents`` or ``items``, or ``data_1`` / ``data_2``), paired 1:1, 1:N or N:N."""
    model, priority, cap = _common(raw)
    names = next((pair for pair in SCORE_FIELDS_ALL if pair[0] in raw and pair[1] in raw), None)
    if names is None:
        raise invalid_value(
            "text_1", "a score request needs text_1 and text_2 (or queries and documents)"
        )
    first = _texts(raw[names[0]], names[0])
    second = _texts(raw[names[1]], names[1])
    if len(first) > 1 and len(first) != len(second):
        raise invalid_value(
            names[1],
            f"{names[0]} holds {len(first)} items and {names[1]} {len(second)}: "
            "input lengths must be either 1:1, 1:N or N:N",
        )
    tokens, pairs = _pairs(raw, first, second, tokenizer, cap)
    return PoolingRequest(
        kind="score",
        model=model,
        priority=priority,
        tokens=tokens,
        pairs=pairs,
        field=names[1],
    )


def _inputs(
    raw: Mapping[str, Any], tokenizer: Tokenizer | None
) -> tuple[EmbeddingsRequest, tuple[int, ...]]:
    """The ``input`` of a classify or pooling request, as ``/v1/embeddings`` takes it."""
    if "messages" in raw and "input" not in raw:
        raise ApiError(
            400,
            "unsupported_value",
            "messages is not supported on the pooling routes here: send input (a string, "
            "strings or token ids)",
            "messages",
        )
    parsed = parse_embeddings_request(raw, tokenizer=tokenizer)
    if len(parsed.tokens) > MAX_ITEMS:  # (embeddings' own bound is the same)
        raise invalid_value("input", f"input holds more than {MAX_ITEMS:,} items")
    cap = _common(raw)[2]
    return parsed, tuple(_capped(t, cap) for t in parsed.tokens)


def _activation(raw: Mapping[str, Any]) -> bool:
    for name in ("use_activation", "activation", "softmax", "normalize"):
        value = raw.get(name)
        if value is not None and type(value) is not bool:
            raise invalid_value(name, f"{name} must be a boolean")
        if value is False:
            return False
    return True


def parse_classify_request(
    raw: Mapping[str, Any], *, tokenizer: Tokenizer | None = None
) -> PoolingRequest:
    """``/classify``: ``input`` as ``/v1/embeddings`` takes it (Rule 3)."""
    parsed, tokens = _inputs(raw, tokenizer)
    return PoolingRequest(
        kind="classify",
        model=parsed.model,
        priority=parsed.priority,
        tokens=tokens,
        keys=parsed.keys,
        activation=_activation(raw),
    )


def parse_pooling_request(
    raw: Mapping[str, Any], *, tokenizer: Tokenizer | None = None
) -> PoolingRequest:
    """``/pooling``: ``input``, ``task`` (``embed`` or ``classify``), ``dimensions``,
    ``encoding_format`` (Rule 3)."""
    parsed, tokens = _inputs(raw, tokenizer)
    task = raw.get("task")
    if task not in (None, "embed", "classify"):
        raise ApiError(
            400,
            "unsupported_value",
            f"task {_short(task)} is not served here: use 'embed' (the default) or 'classify'",
            "task",
        )
    return PoolingRequest(
        kind="pooling",
        model=parsed.model,
        priority=parsed.priority,
        tokens=tokens,
        keys=parsed.keys,
        activation=_activation(raw),
        task=task or "embed",
        encoding_format=parsed.encoding_format,
        dimensions=parsed.dimensions,
    )


# --------------------------------------------------------------------------- bodies


def class_probs(seed: int, model: str, key: bytes, activation: bool) -> list[float]:
    """One input's class probabilities (or logits without ``activation``; Rule 3)."""
    digest = hashlib.sha256(b"%d\x00cls\x00" % seed + model.encode() + b"\x00" + key).digest()
    logits = np.random.default_rng(int.from_bytes(digest[:16], "little")).normal(
        0.0, 2.0, NUM_CLASSES
    )
    if not activation:
        return [round(float(x), 8) for x in logits]
    exp = np.exp(logits - logits.max())
    return [round(float(x), 8) for x in exp / exp.sum()]


def _usage(prompt: int) -> bytes:
    return dumps(
        {
            "prompt_tokens": prompt,
            "total_tokens": prompt,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        }
    )


def _head(prefix: str, model: str, created: int) -> bytes:
    return (
        b'{"id":'
        + dumps(f"{prefix}-{random_hex()}")
        + b',"object":"list","created":%d,"model":' % created
        + dumps(model)
        + b',"data":['
    )


#: Pairs scored between two yields of a body's pieces (a checkpoint each).
SCORE_CHUNK = 64


def _scores(request: PoolingRequest, seed: int, out: list[float]) -> Iterator[bytes]:
    """Score every pair into ``out`` (Rule 2), yielding an empty piece every
    :data:`SCORE_CHUNK` pairs so a large request never holds up the event loop."""
    scorers: dict[int, _Scorer] = {}
    for i, (query, document) in enumerate(request.pairs):
        scorer = scorers.get(id(query))
        if scorer is None:
            scorer = scorers[id(query)] = _Scorer(seed, request.model, query)
        out.append(scorer.score(document))
        if i % SCORE_CHUNK == SCORE_CHUNK - 1:
            yield b""


def _rerank_pieces(request: PoolingRequest, seed: int) -> Iterator[bytes]:
    scores: list[float] = []
    yield from _scores(request, seed, scores)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if request.top_n:
        order = order[: request.top_n]
    prompt = sum(request.tokens)
    yield (
        b'{"id":'
        + dumps(f"rerank-{random_hex()}")
        + b',"model":'
        + dumps(request.model)
        + b',"usage":'
        + dumps({"prompt_tokens": prompt, "total_tokens": prompt})
        + b',"results":['
    )
    for rank, i in enumerate(order):
        item = {
            "index": i,
            "document": {"text": request.documents[i]},
            "relevance_score": round(scores[i], 8),
        }
        yield (b"," if rank else b"") + dumps(item)
    yield b"]}"


def _item(request: PoolingRequest, i: int, seed: int, dim: int) -> bytes:
    """One classify or pooling item (Rule 3)."""
    probs = (
        class_probs(seed, request.model, request.keys[i], request.activation)
        if request.kind == "classify" or request.task == "classify"
        else None
    )
    if request.kind == "classify":
        assert probs is not None
        label = f"LABEL_{int(np.argmax(probs))}"
        return dumps({"index": i, "label": label, "probs": probs, "num_classes": NUM_CLASSES})
    if probs is not None:
        data = dumps(probs)
    else:
        vector = embedding_vector(seed, request.model, request.keys[i], dim)
        data = encode_vector(vector, request.encoding_format)
    return b'{"index":%d,"object":"pooling","data":' % i + data + b"}"


def pooling_pieces(
    request: PoolingRequest, *, seed: int, created: int, dim: int
) -> Iterator[bytes]:
    """The response body in pieces, one item each (empty pieces between chunks of
    scores); they concatenate to the whole JSON object. ``dim`` is a pooling request's
    vector length."""
    if request.kind == "rerank":
        yield from _rerank_pieces(request, seed)
        return
    prefix = {"score": "score", "classify": "classify", "pooling": "pool"}[request.kind]
    yield _head(prefix, request.model, created)
    if request.kind == "score":
        scores: list[float] = []
        yield from _scores(request, seed, scores)
        for i, score in enumerate(scores):
            lead = b"," if i else b""
            yield (
                lead + b'{"index":%d,"object":"score","score":' % i + dumps(round(score, 8)) + b"}"
            )
    else:
        for i in range(len(request.tokens)):
            yield (b"," if i else b"") + _item(request, i, seed, dim)
    yield b'],"usage":' + _usage(sum(request.tokens)) + b"}"


def check_pooling_dimensions(request: PoolingRequest, model_dim: int) -> int:
    """A pooling request's vector length: ``dimensions`` (at most the model's) or the
    model's, within ``/v1/embeddings``' bound on values per request."""
    dim = request.dimensions if request.dimensions is not None else model_dim
    if dim > model_dim:
        raise invalid_value(
            "dimensions", f"dimensions must be at most {model_dim} for model {request.model!r}"
        )
    values = dim * len(request.tokens)
    if request.kind == "pooling" and values > MAX_EMBEDDING_VALUES:
        raise invalid_value(
            "input",
            f"{len(request.tokens):,} inputs x {dim:,} dimensions = {values:,} values, more "
            f"than this server's {MAX_EMBEDDING_VALUES:,} per request: send fewer inputs",
        )
    return dim
