"""A completions prompt's own logprobs, for ``echo`` with ``logprobs`` (prompt scoring).

lm-eval-harness's ``local-completions`` scores a continuation by sending the context and
the continuation as one prompt with ``echo: true``, ``logprobs: 1`` and ``max_tokens`` 0
or 1, and reading ``token_logprobs`` and ``top_logprobs`` over the prompt's tokens. So
each prompt token gets an entry, as vLLM gives them: the token's text, its logprob, and
its top alternatives; the first prompt token has none (``null``), nothing comes before
it.

Rule 1: the prompt's tokens are the model's: a real tokenizer's ids, each decoded alone;
        the byte rule's 4-byte chunks of the text's UTF-8, each the characters that
        start in it (so they concatenate to the prompt); a token-id prompt's ids under
        the byte rule are their placeholder words, as ``echo`` writes them.
Rule 2: every prompt token but the first has logprob -0.25 and is its own top entry,
        followed by ``top - 1`` placeholder words at -2.25, -4.25, ... (the completion
        tokens' values, :mod:`inference_lab.api.text` Rule 3), so a greedy check finds
        every token greedy.
Rule 3: ``text_offset`` counts the prompt tokens' texts from 0; the answer's tokens
        continue from the echoed text's length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from inference_lab.api.text import WORDS
from inference_lab.api.tokenizer import Tokenizer
from inference_lab.jsonbytes import dumps

__all__ = [
    "prompt_entries",
    "prompt_field",
    "prompt_logprobs",
    "prompt_token_texts",
    "with_prompt_logprobs",
]


def _byte_chunks(text: str) -> tuple[str, ...]:
    """The byte rule's tokens of ``text`` (Rule 1): ``ceil(bytes / 4)`` pieces, piece ``i``
    holding the characters whose first byte lies in bytes ``4i .. 4i + 3``."""
    data_len = 0
    pieces: list[list[str]] = []
    for char in text:
        index = data_len // 4
        while len(pieces) <= index:
            pieces.append([])
        pieces[index].append(char)
        data_len += len(char.encode("utf-8", "surrogatepass"))
    while len(pieces) < -(-data_len // 4):
        pieces.append([])
    return tuple("".join(piece) for piece in pieces)


def prompt_token_texts(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> tuple[str, ...]:
    """The text of each of ``prompt``'s tokens (Rule 1); as many as the prompt counts."""
    if isinstance(prompt, str):
        if not tokenizer.exact:
            return _byte_chunks(prompt)
        return tuple(tokenizer.decode([token]) for token in tokenizer.encode(prompt))
    if not tokenizer.exact:
        return tuple(WORDS[token % len(WORDS)] for token in prompt)
    return tuple(tokenizer.decode([token]) for token in prompt)


def _top(index: int, token: str, top: int) -> dict[str, float]:
    entries = {token: -0.25}
    rank = 1
    while len(entries) < max(top, 1):
        word = WORDS[(index + rank) % len(WORDS)]
        if word not in entries:
            entries[word] = -0.25 - 2.0 * len(entries)
        rank += 1
    return entries


def _top_json(index: int, token: str, top: int) -> bytes:
    """``dumps(_top(index, token, top))``, built without the JSON encoder's dict pass."""
    parts = [
        dumps(word) + b":" + repr(value).encode() for word, value in _top(index, token, top).items()
    ]
    return b"{" + b",".join(parts) + b"}"


def prompt_entries(
    texts: Sequence[str], top: int, start: int = 0, stop: int | None = None
) -> Iterator[tuple[str, float | None, dict[str, float] | None, int]]:
    """``(token, logprob, top_logprobs, text_offset)`` of prompt tokens ``start ..
    stop - 1`` (Rules 2-3)."""
    stop = len(texts) if stop is None else stop
    offset = sum(len(t) for t in texts[:start])
    for i in range(start, stop):
        token = texts[i]
        if i == 0:
            yield token, None, None, offset
        else:
            yield token, -0.25, _top(i, token, top), offset
        offset += len(token)


def prompt_field(texts: Sequence[str], top: int, field: int, start: int, stop: int) -> bytes:
    """One of the four arrays' JSON entries for prompt tokens ``start .. stop - 1``,
    comma-joined (``field``: 0 tokens, 1 token_logprobs, 2 top_logprobs, 3 text_offset):
    what :func:`prompt_entries` gives, built for the one field a body piece needs."""
    if field == 0:
        return b",".join(dumps(texts[i]) for i in range(start, stop))
    if field == 1:
        head = [b"null"] if start == 0 else []
        return b",".join(head + [b"-0.25"] * (stop - max(start, 1)))
    if field == 2:
        head = [b"null"] if start == 0 else []
        rest = (_top_json(i, texts[i], top) for i in range(max(start, 1), stop))
        return b",".join([*head, *rest])
    offset = sum(len(t) for t in texts[:start])
    out = []
    for i in range(start, stop):
        out.append(b"%d" % offset)
        offset += len(texts[i])
    return b",".join(out)


def prompt_logprobs(texts: Sequence[str], top: int) -> dict[str, list[Any]]:
    """The four arrays of the prompt's entries (Rules 2-3)."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token, logprob, alternatives, offset in prompt_entries(texts, top):
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
    return out


def with_prompt_logprobs(
    texts: Sequence[str], top: int, answer: dict[str, list[Any]]
) -> dict[str, list[Any]]:
    """The prompt's entries (Rules 2-3), then the answer's (``answer``: its four arrays)."""
    out = prompt_logprobs(texts, top)
    for key, values in answer.items():
        out[key].extend(values)
    return out
