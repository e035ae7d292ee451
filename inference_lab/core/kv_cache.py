"""The KV cache of one worker: the block pool and the manager the scheduler asks.

Modelled on vLLM v1's split. The **block pool** owns the blocks: how many are free, the
reference counts of the blocks that hold a known prefix (hash -> count), and the
least-recently-used queue of those no request holds. The **manager** answers the
scheduler's two questions about a request — how many of its blocks are already computed
here, and allocate the rest — and keeps the request's side of the books (which cached
blocks it holds, how many private ones). The scheduler (``engine.py``) only asks.

A request may carry a chain of block hashes: hash ``i`` stands for tokens
``[0, (i + 1) * block_size)`` and includes its parent's, so two requests share block ``i``
exactly when they share the first ``i + 1`` hashes, and a prefix match is a walk from the
first hash. The engine treats hashes as opaque integers.

Rule 1: blocks are conserved: ``free`` + the private blocks of the running requests + the
        cached blocks some request holds (reference count > 0) = ``total``. ``free``
        counts empty blocks and evictable cached blocks alike: both can be allocated.
Rule 2: a cached block no request holds stays in the pool, hittable, until an allocation
        needs it: allocations take empty blocks first and then evict the least recently
        freed cached block. A request gives its blocks back tail first, so its last
        blocks are evicted before its first ones (a shared prefix outlives a tail).
Rule 3: a request's cached blocks are always a prefix of its hash chain (``held`` is
        ``hashes[:len(held)]``). A block becomes cached when the request's computed
        positions fill it; if its hash is already cached (another request computed the
        same block meanwhile), the request's own copy goes back to the pool and it holds
        the cached one instead.
Rule 4: at admission the cached prefix is ``floor(min(cached, limit) / block_size)``
        blocks, where ``limit`` is the positions the request must have resident minus one
        (its last position is always computed, as in vLLM): ``P - 1`` for a new request,
        ``P + output - 1`` for a preempted plain request, ``P - 1`` for a group (its
        sequences' own blocks are never cached). Queries and hits are counted in tokens
        at every admission; a request's ``cached`` is the hit of its first one.
Rule 5: with prefix caching off, or for a request without hashes, nothing here looks at
        a hash: the accounting is a plain count of free blocks.
Rule 6: no clock, no I/O. Events (blocks stored, removed, all cleared) are recorded only
        when asked for, for a publisher outside the engine to drain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "KVCacheManager",
    "KVEvent",
    "NO_HASHES",
    "NOT_CACHED",
]

#: ``cache_at`` of a request with nothing (more) to cache: never reached.
NOT_CACHED = 1 << 62
#: The empty chain (and the empty ``held`` of a request without hashes; never mutated).
NO_HASHES: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class BlockStored:
    """Blocks became cached on ``worker``: ``block_hashes`` in chain order, the first one's
    parent being ``parent_block_hash`` (None for the chain's first block)."""

    worker: int
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Cached blocks of ``worker`` were evicted (their hashes no longer hit there)."""

    worker: int
    block_hashes: tuple[int, ...]


@attrs.frozen(kw_only=True)
class AllBlocksCleared:
    """Every cached block of ``worker`` was dropped (:meth:`Engine.reset_prefix_cache`)."""

    worker: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class CachedRequest(Protocol):
    """What the manager reads and writes on a request (the engine's ``_Request``)."""

    prompt: int
    output: int
    n: int
    computed: int
    blocks: int
    hashes: tuple[int, ...]
    hash_limit: int
    held: list[int] | tuple[int, ...]
    cache_at: int
    cached: int


class BlockPool:
    """The blocks of one worker (Rule 1, Rule 2). Called by :class:`KVCacheManager`."""

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
        self.queries = 0  # tokens asked for at admissions (Rule 4)
        self.hits = 0  # of them, tokens found cached
        #: running requests that may still cache a block (0: a step end has nothing to
        #: look at, so a workload without hashes pays nothing per batch member)
        self.filling = 0

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
            gone = []
            for _ in range(excess):
                h = next(iter(evictable))
                del evictable[h]
                del ref[h]
                gone.append(h)
            if self.events is not None:
                self.events.append(BlockRemoved(worker=self.worker, block_hashes=tuple(gone)))

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
        holds the cached block instead (False; Rule 3)."""
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


class KVCacheManager:
    """The scheduler's view of one worker's KV cache: what a request finds computed, and
    its blocks taken, cached and given back. ``blocks_for(positions)`` is the worker's
    block count for a sequence holding that many positions (content plus private)."""

    __slots__ = ("pool", "block_size", "enabled")

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled

    def prepare(self, r: CachedRequest) -> None:
        """Set a new request's cache fields: how many of its hashes may ever be cached
        here (a group's sequences share only the full prompt blocks). A request without
        hashes, or prefix caching off: none (Rule 5)."""
        r.cached = 0
        r.cache_at = NOT_CACHED
        if not self.enabled or not r.hashes:
            r.hash_limit = 0
            r.held = NO_HASHES
            return
        limit = len(r.hashes)
        if r.n > 1:
            limit = min(limit, r.prompt // self.block_size)
        r.hash_limit = limit
        r.held = []

    def computed_blocks(self, r: CachedRequest) -> tuple[int, int]:
        """For a request about to be admitted (nothing resident): how many of its leading
        blocks are cached here (Rule 4), and how many of those no request holds (taking
        them costs as many free blocks)."""
        if not r.hash_limit:
            return 0, 0
        if r.n == 1 and r.output:
            limit = r.prompt + r.output - 1
        else:
            limit = r.prompt - 1
        pool = self.pool
        k = pool.hit_blocks(r.hashes, min(r.hash_limit, limit // self.block_size))
        if not k:
            return 0, 0
        return k, pool.evictable_among(r.hashes, k)

    def hit_tokens(self, r: CachedRequest) -> int:
        """The cached prefix a new request would find here, in tokens (the routers ask)."""
        if not r.hash_limit:
            return 0
        limit = min(r.hash_limit, (r.prompt - 1) // self.block_size)
        return self.pool.hit_blocks(r.hashes, limit) * self.block_size

    def admit(self, r: CachedRequest, hit: int, new_blocks: int, first: bool) -> None:
        """Admit ``r`` (nothing resident) holding its ``hit`` cached leading blocks plus
        ``new_blocks`` allocated ones, its computed positions those of the hit; count the
        query and the hit (Rule 4). ``first``: its first admission (sets ``cached``)."""
        pool = self.pool
        bs = self.block_size
        if self.enabled:
            pool.queries += r.prompt + (r.output - 1 if r.output > 1 else 0)
            pool.hits += hit * bs
        if hit:
            pool.touch(r.hashes, hit)
            r.held.extend(r.hashes[:hit])  # type: ignore[union-attr]  # a list: hash_limit > 0
            r.computed = hit * bs
        if first:
            r.cached = hit * bs
        if hit < r.hash_limit:
            r.cache_at = (hit + 1) * bs
            pool.filling += 1
        pool.allocate(new_blocks)
        r.blocks = hit + new_blocks

    def cache_batch(self, batch: Sequence[tuple[CachedRequest, int]]) -> None:
        """A step ends: each member still holding its blocks and computing ``n`` more
        positions caches the blocks they fill. Called only while ``pool.filling``."""
        for r, n in batch:
            c = r.computed + n
            if c >= r.cache_at:  # freed (finished, preempted, aborted): never
                self.cache_computed(r, c)

    def cache_computed(self, r: CachedRequest, positions: int) -> None:
        """``r``'s computed positions reached ``cache_at``: cache every block its
        ``positions`` fill (Rule 3); one stored event per run of blocks newly cached."""
        held = r.held
        bs = self.block_size
        start = len(held)
        full = min(positions // bs, r.hash_limit)
        pool = self.pool
        hashes = r.hashes
        events = pool.events
        run: list[int] = []
        parent: int | None = None
        for i in range(start, full):
            h = hashes[i]
            if pool.store(h):
                if not run:
                    parent = hashes[i - 1] if i else None
                run.append(h)
            elif run and events is not None:
                events.append(self._stored(run, parent))
                run = []
            held.append(h)  # type: ignore[union-attr]  # a list: hash_limit > 0
        if run and events is not None:
            events.append(self._stored(run, parent))
        if full < r.hash_limit:
            r.cache_at = (full + 1) * bs
        else:
            r.cache_at = NOT_CACHED
            pool.filling -= 1

    def _stored(self, run: list[int], parent: int | None) -> BlockStored:
        return BlockStored(
            worker=self.pool.worker, block_hashes=tuple(run), parent_block_hash=parent
        )

    def free(self, r: CachedRequest) -> None:
        """Give back every block ``r`` holds (finished, preempted or aborted): cached ones
        to the evictable queue, tail first, its own ones to the empty blocks."""
        held = r.held
        pool = self.pool
        pool.release(held, r.blocks - len(held))
        r.blocks = 0
        if held:
            held.clear()  # type: ignore[union-attr]  # non-empty: a list
        if r.cache_at != NOT_CACHED:
            r.cache_at = NOT_CACHED
            pool.filling -= 1
