"""The scheduler's view of one worker's KV cache: what a request finds computed, and its
blocks taken, cached and given back.

Modelled on vLLM v1's ``kv_cache_manager.py``: the scheduler asks two questions of a
request -- how many of its blocks are already computed here, and allocate the blocks for
this many positions -- and this module is the only code that changes a request's block
counts (``num_blocks``, ``block_room``, its held cached blocks) or the pool's
(:mod:`~inference_lab.core.engine.block_pool`).

A request may carry a chain of block hashes: hash ``i`` stands for tokens
``[0, (i + 1) * block_size)`` and includes its parent's, so two requests share block ``i``
exactly when they share the first ``i + 1`` hashes, and a prefix match is a walk from the
first hash. Hashes are opaque integers here.

Rule 1: a sequence holding ``p`` positions needs ``blocks_for(p)`` blocks: its content
        blocks plus its private ones (windowed KV and recurrent state: the roofline's
        ``blocks_for``). A group of ``n`` sequences holding ``c`` positions each needs
        ``blocks_for(c)`` while ``c <= P`` and ``s + n * (blocks_for(c) - s)`` after,
        where ``s = P // block_size`` is the number of full prompt blocks its sequences
        share.
Rule 2: a request's cached blocks are always a prefix of its hash chain (``held_hashes``
        is ``block_hashes[:len(held_hashes)]``). A block becomes cached when the
        request's computed positions fill it; if its hash is already cached (another
        request computed the same block meanwhile), the request's own copy goes back to
        the pool and it holds the cached one instead.
Rule 3: at admission the cached prefix is ``floor(min(cached, limit) / block_size)``
        blocks, where ``limit`` is the positions the request must have resident minus one
        (its last position is always computed, as in vLLM): ``P - 1`` for a new request,
        ``P + output - 1`` for a preempted plain request, ``P - 1`` for a group (its
        sequences' own blocks are never cached). Queries and hits are counted in tokens
        at every admission; a request's ``cached_tokens`` is the hit of its first one.
Rule 4: with prefix caching off, or for a request without hashes, nothing here looks at
        a hash: the accounting is a plain count of free blocks.
Rule 5: with ``[scheduler] hash_every_prompt`` (vLLM hashes every request's full blocks,
        so a preempted request finds its own computed blocks in the prefix cache), a
        plain request without hashes that is preempted first takes a private chain
        (:func:`private_chain`: no other request's hash) of its prompt and outputs, and
        its computed full blocks are cached under it before they are freed (evictable,
        tail first). Its readmission then finds them as any request finds its prefix
        (Rule 3); it caches the blocks it fills from then on. Until its first
        preemption nothing could hit its blocks, so nothing else differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import Protocol

from inference_lab.core.engine.block_pool import NO_HASHES, NOT_CACHED, BlockPool, BlockStored

__all__ = ["CachedRequest", "GrowingRequest", "KVCacheManager", "private_chain"]


class CachedRequest(Protocol):
    """What the manager reads and writes on a request (``request.Request``)."""

    prompt_tokens: int
    num_output: int
    n: int
    num_computed: int
    num_blocks: int
    block_room: int
    block_hashes: tuple[int, ...]
    cacheable_blocks: int
    held_hashes: list[int] | tuple[int, ...]
    next_cache_position: int
    cached_tokens: int
    lora: int
    lora_name: str | None


def private_chain(request_id: int, blocks: int) -> tuple[int, ...]:
    """Rule 5: a chain of ``blocks`` hashes that only request ``request_id`` of its
    engine holds: block ``i``'s is BLAKE2b (8-byte digest, read as an unsigned
    little-endian integer, as every chain's) of the label ``private``, the id and ``i``,
    so it meets no content chain (a 64-bit collision aside) and no other request's."""
    out = []
    for i in range(blocks):
        h = blake2b(b"private", digest_size=8)
        h.update(request_id.to_bytes(8, "little", signed=True))
        h.update(i.to_bytes(8, "little"))
        out.append(int.from_bytes(h.digest(), "little"))
    return tuple(out)


class GrowingRequest(Protocol):
    """What the fast path's growth changes on a request (its block counts)."""

    num_blocks: int
    block_room: int


class KVCacheManager:
    """One worker's KV cache as the scheduler asks it (Rules 1-4). ``blocks_for`` and
    ``room_for`` are the deployment's (the roofline's): blocks for a number of resident
    positions, and the most positions a number of blocks holds."""

    __slots__ = ("pool", "block_size", "enabled", "private", "_blocks_for", "room_for")

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enabled: bool,
        *,
        blocks_for: Callable[[int], int],
        room_for: Callable[[int], int],
        private: bool,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        #: whether sequences hold private blocks (else ``blocks_for`` is a ceiling)
        self.private = private
        self._blocks_for = blocks_for
        self.room_for = room_for

    # ------------------------------------------------------------------ block counts
    def blocks_for(self, positions: int) -> int:
        """Blocks one sequence holding ``positions`` positions needs (Rule 1)."""
        if self.private:
            return self._blocks_for(positions)
        return -(-positions // self.block_size)

    def group_blocks(self, r: CachedRequest, positions: int) -> int:
        """Blocks ``r`` needs when each of its sequences holds ``positions`` (Rule 1)."""
        base = self.blocks_for(positions)
        if r.n == 1 or positions <= r.prompt_tokens:
            return base
        shared = r.prompt_tokens // self.block_size
        return shared + r.n * (base - shared)

    def allocate(self, r: CachedRequest, positions: int) -> int | None:
        """Make ``r`` (running) hold the blocks of ``positions`` positions per sequence:
        the blocks it then holds, or None (nothing changed) when the free blocks cannot
        cover what it lacks. Taking blocks may evict cached ones no request holds."""
        need = (
            self.blocks_for(positions) if r.n == 1 else self.group_blocks(r, positions)
        ) - r.num_blocks
        pool = self.pool
        if need > pool.free:
            return None
        if need > 0:
            pool.free -= need
            if pool.evictable:  # cached blocks may have to go (empty ones first)
                pool.evict_excess()
            r.num_blocks += need
        if r.n == 1:
            r.block_room = self.room_for(r.num_blocks)
        return r.num_blocks

    def grow_to(self, r: GrowingRequest, blocks: int) -> None:
        """The scheduler's fast path: ``r`` (plain, running) holds at least ``blocks``
        blocks; the caller checked the free blocks cover every such growth of its step
        and that no cached block is evictable."""
        if blocks > r.num_blocks:
            self.pool.free -= blocks - r.num_blocks
            r.num_blocks = blocks
        r.block_room = self.room_for(r.num_blocks)

    def grow_by_one(self, filed: Sequence[tuple[GrowingRequest, int]]) -> None:
        """The scheduler's fast path: the request of each ``(request, lazy base)`` pair
        of ``filed`` (plain, running, past their private blocks' growth: its grow
        calendar's entries) takes one more block, which holds ``block_size`` more
        positions; the caller checked the free blocks and that none is evictable."""
        bs = self.block_size
        self.pool.free -= len(filed)
        for r, _ in filed:
            r.num_blocks += 1
            r.block_room += bs

    # ------------------------------------------------------------------ the prefix cache
    def prepare(self, r: CachedRequest) -> None:
        """Set a new request's cache fields: how many of its hashes may ever be cached
        here (a group's sequences share only the full prompt blocks). A request without
        hashes, or prefix caching off: none (Rule 4)."""
        r.cached_tokens = 0
        r.next_cache_position = NOT_CACHED
        if not self.enabled or not r.block_hashes:
            r.cacheable_blocks = 0
            r.held_hashes = NO_HASHES
            return
        limit = len(r.block_hashes)
        if r.n > 1:
            limit = min(limit, r.prompt_tokens // self.block_size)
        r.cacheable_blocks = limit
        r.held_hashes = []

    def computed_blocks(self, r: CachedRequest) -> tuple[int, int]:
        """For a request about to be admitted (nothing resident): how many of its leading
        blocks are cached here (Rule 3), and how many of those no request holds (taking
        them costs as many free blocks)."""
        if not r.cacheable_blocks:
            return 0, 0
        if r.n == 1 and r.num_output:
            limit = r.prompt_tokens + r.num_output - 1
        else:
            limit = r.prompt_tokens - 1
        pool = self.pool
        k = pool.hit_blocks(r.block_hashes, min(r.cacheable_blocks, limit // self.block_size))
        if not k:
            return 0, 0
        return k, pool.evictable_among(r.block_hashes, k)

    def hit_tokens(self, r: CachedRequest) -> int:
        """The cached prefix a new request would find here, in tokens (the routers ask)."""
        if not r.cacheable_blocks:
            return 0
        limit = min(r.cacheable_blocks, (r.prompt_tokens - 1) // self.block_size)
        return self.pool.hit_blocks(r.block_hashes, limit) * self.block_size

    def admit(self, r: CachedRequest, hit: int, new_blocks: int, first: bool) -> None:
        """Admit ``r`` (nothing resident) holding its ``hit`` cached leading blocks plus
        ``new_blocks`` allocated ones, its computed positions those of the hit; count the
        query and the hit (Rule 3). ``first``: its first admission (sets
        ``cached_tokens``)."""
        pool = self.pool
        bs = self.block_size
        if self.enabled:
            out = r.num_output
            pool.queries += r.prompt_tokens + (out - 1 if out > 1 else 0)
            pool.hits += hit * bs
        if hit:
            pool.touch(r.block_hashes, hit)
            r.held_hashes.extend(r.block_hashes[:hit])  # type: ignore[union-attr]  # a list
            r.num_computed = hit * bs
        if first:
            r.cached_tokens = hit * bs
        if hit < r.cacheable_blocks:
            r.next_cache_position = (hit + 1) * bs
            pool.filling += 1
        if pool.evictable:
            pool.allocate(new_blocks)
        else:  # (BlockPool.allocate with nothing evictable, inline)
            pool.free -= new_blocks
        r.num_blocks = hit + new_blocks

    def admit_plain(self, r: CachedRequest, new_blocks: int, first: bool) -> None:
        """:meth:`admit` for a request with nothing cached and no cacheable block (no hit)
        while nothing is evictable: the same fields, the same counts."""
        if self.enabled:
            out = r.num_output
            self.pool.queries += r.prompt_tokens + (out - 1 if out > 1 else 0)
        if first:
            r.cached_tokens = 0
        self.pool.free -= new_blocks
        r.num_blocks = new_blocks

    def cache_batch(self, batch: Sequence[tuple[CachedRequest, int]]) -> None:
        """A step ends: each member still holding its blocks and computing ``n`` more
        positions caches the blocks they fill. Called only while ``pool.filling``."""
        for r, n in batch:
            c = r.num_computed + n
            if c >= r.next_cache_position:  # freed (finished, preempted, aborted): never
                self.cache_computed(r, c)

    def cache_computed(self, r: CachedRequest, positions: int) -> None:
        """``r``'s computed positions reached ``next_cache_position``: cache every block
        its ``positions`` fill (Rule 2); one stored event per run of blocks newly cached."""
        held = r.held_hashes
        bs = self.block_size
        start = len(held)
        full = min(positions // bs, r.cacheable_blocks)
        pool = self.pool
        hashes = r.block_hashes
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
                events.append(self._stored(run, parent, r))
                run = []
            held.append(h)  # type: ignore[union-attr]  # a list: cacheable_blocks > 0
        if run and events is not None:
            events.append(self._stored(run, parent, r))
        if full < r.cacheable_blocks:
            r.next_cache_position = (full + 1) * bs
        else:
            r.next_cache_position = NOT_CACHED
            pool.filling -= 1

    def _stored(self, run: list[int], parent: int | None, r: CachedRequest) -> BlockStored:
        if r.lora:  # (its adapter: lora Rule 4)
            return BlockStored(
                worker=self.pool.worker,
                block_hashes=tuple(run),
                parent_block_hash=parent,
                lora_id=r.lora,
                lora_name=r.lora_name,
            )
        return BlockStored(
            worker=self.pool.worker, block_hashes=tuple(run), parent_block_hash=parent
        )

    def cache_preempted(self, r: CachedRequest, chain: tuple[int, ...]) -> None:
        """Rule 5: ``r`` (plain, running, no hashes of its own) is about to be preempted:
        it takes ``chain`` and caches the full blocks of its computed positions, so
        :meth:`free` leaves them evictable for its readmission. The scheduler's
        ``_preempt`` calls it, before ``free``."""
        r.block_hashes = chain
        self.prepare(r)
        if not r.cacheable_blocks:
            return
        r.next_cache_position = self.block_size
        self.pool.filling += 1
        self.cache_computed(r, r.num_computed)

    def free(self, r: CachedRequest) -> None:
        """Give back every block ``r`` holds (finished, preempted or aborted): cached ones
        to the evictable queue, tail first, its own ones to the empty blocks."""
        held = r.held_hashes
        pool = self.pool
        if held:
            pool.release(held, r.num_blocks - len(held))
        else:  # (BlockPool.release of its own blocks alone, inline)
            pool.free += r.num_blocks
        r.num_blocks = 0
        r.block_room = 0
        if held:
            held.clear()  # type: ignore[union-attr]  # non-empty: a list
        if r.next_cache_position != NOT_CACHED:
            r.next_cache_position = NOT_CACHED
            pool.filling -= 1
