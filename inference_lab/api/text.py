"""The placeholder text every response carries, where stop strings cut it, its logprobs.

No model runs, so the output is known before it is generated: the text of ``n`` tokens,
where a stop string ends it and the logprobs of each token are pure functions here.

Rule 1: token ``i`` of every response is ``VOCABULARY[i % 50]`` plus a space; the text of
        ``n`` tokens is their concatenation.
Rule 2: a stop string stops the text as vLLM stops it: the token in which it first
        completes is generated and counted, and the text returned ends before it.
Rule 3: logprobs are fixed values: the emitted token at -0.25, then the following words
        of the vocabulary at -2.25, -4.25, ...
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from inference_lab.generate.vocabulary import VOCABULARY

__all__ = [
    "VOCABULARY",
    "WORDS",
    "chat_logprob_entry",
    "chat_logprobs",
    "completion_logprobs",
    "completion_top_logprobs",
    "logprob_alternatives",
    "placeholder_text",
    "stop_point",
    "token_start",
    "tokens_ending_by",
]

#: The text of each placeholder token: its word and a space.
WORDS: tuple[str, ...] = tuple(f"{w} " for w in VOCABULARY)
_CYCLE = "".join(WORDS)
_CYCLE_LEN = len(_CYCLE)
#: _ENDS[k]: the offset just past word k within one cycle of the placeholder text.
_ENDS: tuple[int, ...] = tuple(sum(len(w) for w in WORDS[: k + 1]) for k in range(len(WORDS)))
_STARTS: tuple[int, ...] = (0, *_ENDS[:-1])


def placeholder_text(count: int, start: int = 0) -> str:
    """The text of tokens ``start .. start+count-1``: one word plus a space each."""
    if count <= 0:
        return ""
    offset = start % len(WORDS)
    words = WORDS[offset:] + WORDS[:offset]
    full, rest = divmod(count, len(WORDS))
    return "".join(words) * full + "".join(words[:rest])


def token_start(index: int) -> int:
    """The offset of token ``index`` (0-based) in the placeholder text."""
    cycles, k = divmod(index, len(WORDS))
    return cycles * _CYCLE_LEN + _STARTS[k]


def tokens_ending_by(offset: int) -> int:
    """How many placeholder tokens end at or before text offset ``offset``."""
    cycles, rest = divmod(offset, _CYCLE_LEN)
    return cycles * len(WORDS) + bisect.bisect_right(_ENDS, rest)


def stop_point(stops: Sequence[str], max_tokens: int) -> tuple[int, int] | None:
    """Where the placeholder text of at most ``max_tokens`` tokens stops, as vLLM stops
    it: ``(tokens, chars)``, the number of tokens generated (the token in which a stop
    string first completes is generated and counted) and the length of the text returned
    (everything before that stop string). When several complete in the same token, the
    text is cut before the one that starts first (vLLM takes the first listed; cutting at
    the earliest start guarantees the text holds no stop string). None when no stop
    string completes within ``max_tokens``.

    The text is periodic, so a stop string's first occurrence, if any, starts in the
    first cycle: one cycle plus the longest stop string is all that is searched."""
    longest = max(len(s) for s in stops)
    count = min(max_tokens, ((_CYCLE_LEN + longest) // _CYCLE_LEN + 1) * len(WORDS))
    text = placeholder_text(count)
    best: tuple[int, int] | None = None
    for stop in stops:
        at = text.find(stop)
        if at < 0:
            continue
        candidate = (tokens_ending_by(at + len(stop) - 1) + 1, at)
        if best is None or candidate < best:
            best = candidate
    return best


def logprob_alternatives(word: int, top: int) -> list[tuple[str, float]]:
    """The placeholder logprobs of a token that emits ``VOCABULARY[word]``: the emitted
    token first (logprob -0.25), then ``top - 1`` alternatives, the following words of the
    vocabulary, at -2.25, -4.25, ... (probabilities summing to less than 1). At least the
    emitted token is listed."""
    return [(WORDS[(word + rank) % len(WORDS)], -0.25 - 2.0 * rank) for rank in range(max(top, 1))]


def chat_logprob_entry(word: int, top: int) -> dict[str, Any]:
    """A chat ``logprobs.content`` entry of a token emitting ``VOCABULARY[word]`` with
    ``top`` alternatives."""
    alternatives = logprob_alternatives(word, top)[:top]
    token, logprob = WORDS[word], -0.25
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives
        ],
    }


def completion_top_logprobs(word: int, top: int) -> dict[str, float]:
    """A completions ``top_logprobs`` entry of a token emitting ``VOCABULARY[word]``."""
    return dict(logprob_alternatives(word, top))


def chat_logprobs(count: int, top: int) -> dict[str, Any]:
    """A chat choice's ``logprobs`` for ``count`` tokens."""
    entries = [chat_logprob_entry(w, top) for w in range(len(WORDS))]
    return {"content": [entries[i % len(WORDS)] for i in range(count)]}


def completion_logprobs(count: int, top: int, offset: int) -> dict[str, Any]:
    """A completions choice's ``logprobs`` for ``count`` tokens whose text starts at
    ``offset`` (the echoed prompt's length)."""
    tops = [completion_top_logprobs(w, top) for w in range(len(WORDS))]
    n = len(WORDS)
    return {
        "tokens": [WORDS[i % n] for i in range(count)],
        "token_logprobs": [-0.25] * count,
        "top_logprobs": [tops[i % n] for i in range(count)],
        "text_offset": [offset + token_start(i) for i in range(count)],
    }
