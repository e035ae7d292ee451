"""The KV blocks of one worker: how many are free, which hold a known prefix, and the
order in which cached blocks nobody holds are evicted.

Modelled on vLLM v1's ``block_pool.py``. Blocks are counted, not named: the pool knows
how many are free and, for the blocks that hold a known prefix, their hash's reference
count (how many running requests hold that block) and the least-recently-used queue of
those no request holds. The KV cache manager
(:mod:`~inference_lab.core.engine.kv_cache_manager`) is its only caller.

Rule 1: blocks are conserved: ``free`` + the private blocks of the running requests + the
        cached blocks some request holds (reference count > 0) = ``total``. ``free``
        counts empty blocks and evictable cached blocks alike: both can be allocated.
Rule 2: a cached block no request holds stays in the pool, hittable, until an allocation
        needs it: allocations take empty blocks first and then evict the least recently
        freed cached block. A request gives its blocks back tail first, so its last
        blocks are evicted before its first ones (a shared prefix outlives a tail).
Rule 3: no clock, no I/O. Events (blocks stored, removed, all cleared) are recorded only
        when asked for, for a publisher outside the engine to drain.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

import attrs

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "NOT_CACHED",
    "NO_HASHES",
]

#: ``next_cache_position`` of a request with nothing (more) to cache: never reached.
NOT_CACHED = 1 << 62
#: The empty chain (and the empty ``held_hashes`` of a request without hashes; never
#: mutated).
NO_HASHES: tuple[int, ...] = ()


#: Where a block is (vLLM's ``medium``): HBM, a host-memory tier, a disk tier.
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK = "GPU", "CPU", "DISK"


@attrs.frozen(kw_only=True)
class BlockStored:
    """Blocks became cached on ``worker``: ``block_hashes`` in chain order, the first one's
    parent being ``parent_block_hash`` (None for the chain's first block, or not known:
    a lower tier's store); ``medium`` where (HBM, or a KV tier behind it)."""

    worker: int
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    medium: str = MEDIUM_GPU


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Cached blocks of ``worker`` were evicted from ``medium`` (their hashes no longer
    hit there)."""

    worker: int
    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU


@attrs.frozen(kw_only=True)
class AllBlocksCleared:
    """Every cached block of ``worker`` was dropped (:meth:`Engine.reset_prefix_cache`)."""

    worker: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """The blocks of one worker (Rule 1, Rule 2). Called by the KV cache manager."""

    __slots__ = (
        "total",
        "free",
        "ref",
        "evictable",
        "events",
        "worker",
        "queries",
        "hits",
        "filling",
        "spill",
    )

    def __init__(self, total: int, worker: int, events: list[KVEvent] | None) -> None:
        self.total = total
        self.free = total
        #: hash -> how many running requests hold that cached block (0: evictable)
        self.ref: dict[int, int] = {}
        #: the cached blocks no request holds, least recently freed first (a dict keeps
        #: insertion order: O(1) append, removal and pop of the oldest)
        self.evictable: dict[int, None] = {}
        self.events = events
        self.worker = worker
        self.queries = 0  # tokens asked for at admissions
        self.hits = 0  # of them, tokens found cached
        #: running requests that may still cache a block (0: a step end has nothing to
        #: look at, so a workload without hashes pays nothing per batch member)
        self.filling = 0
        #: where evicted cached blocks go (the KV tiers behind HBM; None: nowhere)
        self.spill: Callable[[list[int]], None] | None = None

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a known prefix, held or evictable."""
        return len(self.ref)

    @property
    def held_cached_blocks(self) -> int:
        return len(self.ref) - len(self.evictable)

    def allocate(self, count: int) -> None:
        """Take ``count`` blocks (the caller checked ``count <= free``): empty blocks
        first, then the least recently freed cached ones, which stop hitting."""
        self.free -= count
        if self.evictable:
            self.evict_excess()

    def evict_excess(self) -> None:
        """After ``free`` dropped: evict the least recently freed cached blocks until the
        evictable ones fit in ``free`` (the empty blocks are ``free - len(evictable)``)."""
        evictable = self.evictable
        excess = len(evictable) - self.free
        if excess > 0:
            ref = self.ref
            # (one pass from the front: a dict's first key lies past the slots earlier
            # pops left behind, so taking them one next(iter()) at a time rescans those)
            gone = list(islice(evictable, excess))
            for h in gone:
                del evictable[h]
                del ref[h]
            if self.events is not None:
                self.events.append(BlockRemoved(worker=self.worker, block_hashes=tuple(gone)))
            if self.spill is not None:
                self.spill(gone)

    def hit_blocks(self, hashes: tuple[int, ...], limit: int) -> int:
        """How many leading hashes of ``hashes`` (at most ``limit``) are cached here."""
        ref = self.ref
        k = 0
        while k < limit and hashes[k] in ref:
            k += 1
        return k

    def evictable_among(self, hashes: tuple[int, ...], count: int) -> int:
        """How many of the first ``count`` hashes (all cached) no request holds: taking
        them costs that many free blocks."""
        ref = self.ref
        return sum(1 for h in hashes[:count] if ref[h] == 0)

    def touch(self, hashes: tuple[int, ...], count: int) -> None:
        """A request takes the first ``count`` hashes (all cached) as its blocks."""
        ref = self.ref
        evictable = self.evictable
        for h in hashes[:count]:
            c = ref[h]
            if c == 0:
                del evictable[h]
                self.free -= 1
            ref[h] = c + 1

    def store(self, h: int) -> bool:
        """One of a request's own blocks, now full, holds the prefix ``h``: it becomes
        cached (True). If ``h`` is cached already the request's copy is given back and it
        holds the cached block instead (False)."""
        ref = self.ref
        c = ref.get(h)
        if c is None:
            ref[h] = 1
            return True
        if c == 0:
            del self.evictable[h]
            self.free -= 1
        ref[h] = c + 1
        self.free += 1  # the request's own copy
        return False

    def release(self, held: list[int] | tuple[int, ...], private: int) -> None:
        """A request gives back its cached blocks ``held`` (tail first: Rule 2) and
        ``private`` blocks of its own."""
        if held:
            ref = self.ref
            evictable = self.evictable
            for h in reversed(held):
                c = ref[h] - 1
                ref[h] = c
                if c == 0:
                    evictable[h] = None
                    self.free += 1
        self.free += private

    def clear(self) -> bool:
        """Drop every cached block, if no request holds one (else False, nothing done):
        they become empty blocks and stop hitting."""
        if len(self.ref) != len(self.evictable):
            return False
        self.ref.clear()
        self.evictable.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared(worker=self.worker))
        return True
