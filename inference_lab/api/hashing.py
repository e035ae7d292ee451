"""The block hashes of a served request: its token stream, hashed in blocks.

The serve side's half of prefix caching: a parsed request carries the hash chain of the
tokens its KV would hold, so the engine finds what an earlier request left cached. The
chain is made of the prompt as the model's tokenizer counts it (after the chat template)
and the answer as the client's next turn will resend it, so a client resending a
conversation hits both the previous prompt and the previous answer.

Rule 1: a request's stream is its prompt's token ids, then the ids of its
        *continuation*: the text that follows the prompt when the next turn renders the
        conversation, up to the answer's end. For completions and for a chat template
        that is the answer (the template's generation prompt already ends the prompt);
        for the default chat rendering it is ``"\\nassistant: "`` and the answer. The
        answer is the placeholder text of the most tokens the request can produce
        (``ParsedRequest.output_cap``), as the non-streaming body holds it, but at most
        :data:`MAX_ANSWER_HASH_TOKENS` of them: hashing happens before admission, so a
        request asking for 100,000 tokens must not cost milliseconds of hashing (nor a
        burst of refused ones seconds); an answer's blocks past that are not cached.
Rule 2: a real tokenizer's stream is the prompt's ids exactly as counted, then
        ``encode(continuation)`` without special tokens (cached per text).
Rule 3: the byte rule's stream is its reversible ids (4-byte chunks of the UTF-8 text,
        :class:`~inference_lab.api.tokenizer.ByteTokenizer`) of the prompt's text and the
        continuation, chunked as one text, so a longer conversation's stream starts with
        a shorter one's. A chat stream carries one template token (id 0, never a byte-rule
        id) after every 20 text tokens: it stands for the template tokens the byte rule
        cannot see, so the prompt's part is ``raw + raw // 20 = raw * 105 // 100`` tokens
        long, the chat count usage reports.
Rule 4: block ``i``'s hash is :func:`inference_lab.traffic.hashing.block_hash` of its
        parent and its ids as 8-byte little-endian integers (the same chain as
        ``traffic.hashing.token_block_hashes``); full blocks only, and none past
        ``prompt + answer tokens`` positions, which the request never computes.
Rule 5: hashing runs only for a model whose deployment caches prefixes (the caller
        passes no :class:`PromptHashing` otherwise), so a request to any other model
        pays nothing.
Rule 6: the digests of each run of :data:`MEMO_GROUP` blocks are remembered by the bytes
        they were computed from (the run's parent digest and its ids), at most
        :data:`BLOCK_MEMO` blocks' worth and one request's, all forgotten when full: a
        conversation resent with one more turn finds its earlier runs there and hashes
        only from its first new run on, where it stops looking (every later run has a new
        parent). The chain is the same with or without it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.api.text import placeholder_text
from inference_lab.api.tokenizer import ByteTokenizer, Tokenizer, default_chat_text

__all__ = [
    "CHAT_TEMPLATE_TOKEN",
    "MAX_ANSWER_HASH_TOKENS",
    "HashedPrompt",
    "PromptHashing",
    "byte_ids",
    "chain_hashes",
    "hash_chat",
    "hash_text",
    "hash_token_ids",
    "with_template_tokens",
]

#: The id standing for a template token in a byte-rule chat stream (Rule 3).
CHAT_TEMPLATE_TOKEN = 0
#: A byte-rule chat stream has one template token after every this many text tokens.
TEMPLATE_EVERY = 20
#: The most answer tokens a request's chain covers (Rule 1).
MAX_ANSWER_HASH_TOKENS = 2048
#: Blocks whose digests are remembered across requests (Rule 6), in runs of
#: :data:`MEMO_GROUP`: about 140 bytes a block (its ids and digest), 2.3 MB in all.
BLOCK_MEMO = 16384
MEMO_GROUP = 16
_block_memo: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}
#: What the default chat rendering writes before an assistant message's content.
DEFAULT_ASSISTANT_PREFIX = "\nassistant: "

Ids = npt.NDArray[np.int64]


@attrs.frozen
class PromptHashing:
    """How a model's requests are hashed: its deployment's ``block_size``; ``keep_tokens``
    keeps each request's stream (the KV-events publisher sends blocks' token ids)."""

    block_size: int
    #: The model's context (``max_seq_len``): no answer longer than it is hashed (a
    #: request that asks for more is refused after parsing anyway).
    max_positions: int
    keep_tokens: bool = False

    def answer(
        self, max_tokens: int, stop_after: int | None, stop_chars: int | None
    ) -> tuple[str, int]:
        """The longest answer's text and tokens (Rule 1): the placeholder text of
        ``stop_after`` tokens cut before its stop string, else of ``max_tokens`` tokens
        without the trailing space, capped at ``max_positions`` and
        :data:`MAX_ANSWER_HASH_TOKENS` tokens (a capped answer keeps its trailing space:
        the full answer goes on past it)."""
        cap = min(self.max_positions, MAX_ANSWER_HASH_TOKENS)
        if stop_after is not None:
            tokens = min(stop_after, cap)
            text = placeholder_text(tokens)
            return (text[:stop_chars] if tokens == stop_after else text), tokens
        tokens = min(max_tokens, cap)
        text = placeholder_text(tokens)
        return (text.rstrip(" ") if tokens == max_tokens else text), tokens


@attrs.frozen
class HashedPrompt:
    """A prompt counted and hashed: ``count`` prompt tokens (what usage reports), the
    chain ``hashes`` and, when kept, the ``tokens`` hashed (the stream's first
    ``len(hashes) * block_size`` ids)."""

    count: int
    hashes: tuple[int, ...]
    tokens: Ids | None = None


def byte_ids(data: bytes) -> Ids:
    """The byte rule's ids of ``data`` (Rule 3): ``(1 << 32) | chunk`` for each whole 4-byte
    chunk (big-endian), then ``(1 << 8k) | rest`` for a last chunk of ``k`` bytes; equal to
    ``ByteTokenizer().encode`` of the text."""
    full = len(data) // 4
    ids = np.frombuffer(data, dtype=">u4", count=full).astype(np.int64)
    ids |= 1 << 32
    rest = len(data) - 4 * full
    if rest:
        last = (1 << (8 * rest)) | int.from_bytes(data[4 * full :], "big")
        ids = np.append(ids, np.int64(last))
    return ids


def with_template_tokens(ids: Ids) -> Ids:
    """``ids`` with :data:`CHAT_TEMPLATE_TOKEN` after every :data:`TEMPLATE_EVERY` of them
    (Rule 3): text id ``j`` lands at position ``j + j // 20``."""
    m = len(ids)
    pads = m // TEMPLATE_EVERY
    out = np.full(m + pads, CHAT_TEMPLATE_TOKEN, dtype=np.int64)
    j = np.arange(m)
    out[j + j // TEMPLATE_EVERY] = ids
    return out


def chain_hashes(ids: Ids, block_size: int, blocks: int) -> tuple[int, ...]:
    """The hashes of the first ``blocks`` full blocks of ``ids`` (Rule 4). Each digest is
    its child's parent bytes as they are, so a block costs one BLAKE2b call; a run of
    :data:`MEMO_GROUP` blocks already hashed after the same parent costs one dictionary
    lookup (Rule 6)."""
    blocks = min(blocks, len(ids) // block_size)
    if blocks <= 0:
        return ()
    buf = ids[: blocks * block_size].astype("<i8", copy=False).tobytes()
    step = 8 * block_size
    span = step * MEMO_GROUP
    memo = _block_memo
    if (len(memo) + 1) * MEMO_GROUP + blocks > BLOCK_MEMO:
        memo.clear()  # bounded (Rule 6): a full memo starts over
    parent = bytes(8)
    out: list[int] = []
    known = True  # past a new run every run is new (its parent is): no more lookups
    for start in range(0, len(buf), span):
        key = parent + buf[start : start + span]
        entry = memo.get(key) if known else None
        if entry is None:
            known = False
            digests = []
            digest = parent
            for at in range(start, min(start + span, len(buf)), step):
                digest = blake2b(digest + buf[at : at + step], digest_size=8).digest()
                digests.append(int.from_bytes(digest, "little"))
            entry = memo[key] = (digest, tuple(digests))
        parent = entry[0]
        out.extend(entry[1])
    return tuple(out)


def _continuation_ids(tokenizer: Tokenizer, text: str) -> Ids:
    """A real tokenizer's ids of a continuation (Rule 2); answers repeat, so cached."""
    return _cached_ids(tokenizer, text)  # type: ignore[arg-type]  # hashed by identity


@functools.lru_cache(maxsize=256)
def _cached_ids(tokenizer: Any, text: str) -> Ids:
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
    ids.setflags(write=False)
    return ids


def _finish(count: int, stream: Ids, answer_tokens: int, hashing: PromptHashing) -> HashedPrompt:
    bs = hashing.block_size
    hashes = chain_hashes(stream, bs, (count + answer_tokens) // bs)
    kept = stream[: len(hashes) * bs] if hashing.keep_tokens else None
    return HashedPrompt(count=count, hashes=hashes, tokens=kept)


def _is_byte_rule(tokenizer: Tokenizer) -> bool:
    return isinstance(tokenizer, ByteTokenizer)


def hash_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Sequence[Any]],
    tools: Sequence[Any] | None,
    answer: str,
    answer_tokens: int,
    hashing: PromptHashing,
) -> HashedPrompt:
    """Count and hash a chat prompt (Rules 1-3); ``answer`` is the text of the longest
    answer (``answer_tokens`` tokens). Raises ChatTemplateError as counting does."""
    if _is_byte_rule(tokenizer):
        text = default_chat_text(messages, tools).encode("utf-8", "surrogatepass")
        raw = -(-len(text) // 4)
        tail = (DEFAULT_ASSISTANT_PREFIX + answer).encode("utf-8", "surrogatepass")
        stream = with_template_tokens(byte_ids(text + tail))
        return _finish(raw * 105 // 100, stream, answer_tokens, hashing)
    prompt = np.asarray(tokenizer.encode_chat(messages, tools), dtype=np.int64)
    templated = bool(getattr(tokenizer, "has_chat_template", False))
    tail_text = answer if templated else DEFAULT_ASSISTANT_PREFIX + answer
    stream = np.concatenate((prompt, _continuation_ids(tokenizer, tail_text)))
    return _finish(len(prompt), stream, answer_tokens, hashing)


def hash_text(
    tokenizer: Tokenizer, prompt: str, answer: str, answer_tokens: int, hashing: PromptHashing
) -> HashedPrompt:
    """Count and hash a completions text prompt (Rules 1-3)."""
    if _is_byte_rule(tokenizer):
        data = prompt.encode("utf-8", "surrogatepass")
        stream = byte_ids(data + answer.encode("utf-8", "surrogatepass"))
        return _finish(-(-len(data) // 4), stream, answer_tokens, hashing)
    ids = np.asarray(tokenizer.encode(prompt), dtype=np.int64)
    stream = np.concatenate((ids, _continuation_ids(tokenizer, answer)))
    return _finish(len(ids), stream, answer_tokens, hashing)


def hash_token_ids(
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    answer: str,
    answer_tokens: int,
    hashing: PromptHashing,
) -> HashedPrompt:
    """Hash a completions prompt given as token ids (counted exactly): the ids, then the
    answer's ids (the byte rule: the answer's own chunks)."""
    try:
        ids = np.asarray(prompt, dtype=np.int64)
    except OverflowError:  # an id no tokenizer has: nothing to share with another request
        return HashedPrompt(count=len(prompt), hashes=())
    if _is_byte_rule(tokenizer):
        tail = byte_ids(answer.encode("utf-8", "surrogatepass"))
    else:
        tail = _continuation_ids(tokenizer, answer)
    return _finish(len(ids), np.concatenate((ids, tail)), answer_tokens, hashing)
