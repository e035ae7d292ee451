"""Block-hash chains: what a request tells the engine about its tokens.

A request's tokens are cut into blocks of the deployment's ``block_size``; block ``i``'s
hash stands for tokens ``[0, (i + 1) * block_size)``: it is a hash of its parent's hash
(block ``i - 1``'s) and of its own content. Two requests share block ``i`` exactly when
they share tokens ``[0, (i + 1) * block_size)``, so a cached prefix is found by walking a
chain from its first hash, as vLLM's prefix cache does.

Rule 1: a hash is BLAKE2b (8-byte digest) of the parent's 8 bytes (zeros for the first
        block) followed by the block's content bytes, read as an unsigned little-endian
        integer: stable across processes and runs (never Python's salted ``hash``).
Rule 2: only full blocks are hashed; a partial last block has no hash.
Rule 3: content is either real token ids (each as 8 little-endian bytes) or a synthetic
        label ``(key, index)`` standing for "the tokens of block ``index`` of stream
        ``key``" (the simulator's conversations have no real tokens). The two kinds never
        meet in one chain.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from hashlib import blake2b

__all__ = [
    "ROOT",
    "SyntheticStream",
    "block_hash",
    "token_block_hashes",
    "trace_block_hashes",
]

#: The parent of a chain's first block.
ROOT = 0

_LABEL = struct.Struct("<qq")


def block_hash(parent: int, content: bytes) -> int:
    """The hash of a block with ``content`` whose previous block hashed to ``parent``
    (:data:`ROOT` for the first block)."""
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(content)
    return int.from_bytes(h.digest(), "little")


def token_block_hashes(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The chain of the full blocks of ``tokens`` (real token ids)."""
    out = []
    parent = ROOT
    ids = array("q", tokens)
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = block_hash(parent, ids[start : start + block_size].tobytes())
        out.append(parent)
    return tuple(out)


def trace_block_hashes(
    hash_ids: Sequence[int], tokens: int, block_size: int, trace_block: int
) -> tuple[int, ...]:
    """The chain at ``block_size`` of a request whose trace names its content by
    ``hash_ids``, one per ``trace_block`` tokens, each standing for the whole prefix up to
    its block's end (Mooncake's traces: 512-token blocks). Block ``i`` covers tokens up to
    ``(i + 1) * block_size``, which lie in trace block ``j = ((i + 1) * block_size - 1) //
    trace_block``: its content label is ``(hash_ids[j], i)``. Only the full blocks of the
    ``tokens`` the ids cover are hashed."""
    out = []
    parent = ROOT
    covered = min(tokens, len(hash_ids) * trace_block)
    for i in range(covered // block_size):
        j = ((i + 1) * block_size - 1) // trace_block
        parent = block_hash(parent, _LABEL.pack(hash_ids[j], i))
        out.append(parent)
    return tuple(out)


class SyntheticStream:
    """The token stream of one conversation, by label: its first ``shared_tokens`` tokens
    are a prefix shared with other streams (``shared``: that prefix's stream, or None for
    none), the rest are its own (``key``). Block ``i`` lying wholly inside the shared
    prefix has the shared stream's hash; any other block is labelled ``(key, i)``.
    Hashes are computed once, as far as asked (:meth:`hashes`)."""

    __slots__ = ("key", "block_size", "shared", "shared_tokens", "_chain")

    def __init__(
        self,
        key: int,
        block_size: int,
        shared: SyntheticStream | None = None,
        shared_tokens: int = 0,
    ) -> None:
        self.key = key
        self.block_size = block_size
        self.shared = shared
        self.shared_tokens = shared_tokens if shared is not None else 0
        self._chain: list[int] = []

    def hashes(self, tokens: int) -> tuple[int, ...]:
        """The chain of the full blocks among the stream's first ``tokens`` tokens."""
        want = tokens // self.block_size
        chain = self._chain
        if len(chain) < want:
            bs = self.block_size
            inherited = self.shared_tokens // bs  # blocks wholly inside the shared prefix
            if len(chain) < inherited and self.shared is not None:
                chain.extend(self.shared.hashes(min(want, inherited) * bs)[len(chain) :])
            parent = chain[-1] if chain else ROOT
            for i in range(len(chain), want):
                parent = block_hash(parent, _LABEL.pack(self.key, i))
                chain.append(parent)
        return tuple(chain[:want])
