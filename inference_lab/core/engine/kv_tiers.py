"""The KV tiers behind HBM: host DRAM and a disk, holding the cached blocks HBM evicts.

vLLM's CPU offloading (``kv_offloading_size``), LMCache, SGLang's HiCache and Dynamo's
KVBM keep the blocks a GPU evicts in host memory, and behind it on local NVMe or a shared
store, so that a returning prefix is fetched instead of recomputed
(``docs/kv-tiers.md``).

Rule 1: a tier is written on eviction: the cached blocks HBM evicts (block pool Rule 2)
        go to the host tier; the host tier, full, passes its least recently used to the
        disk tier; the disk tier, full, drops its own. Writes overlap compute and cost no
        step time (asynchronous copies, as the engines do them).
Rule 2: each tier keeps its blocks by hash in least-recently-used order; a tier is
        inclusive: a block fetched from it stays there (touched).
Rule 3: at admission, after the prefix cached in HBM, the blocks that continue the
        request's chain in the tiers (host or disk, block by block, up to what its prefix
        may hit) are *fetched* when that is cheaper than computing them: the host part
        over the host link (``latency + bytes / (bandwidth x tp)``), the disk part over
        the disk (``latency + bytes / bandwidth``) and then the host link, one after the
        other; computing them is priced as the roofline prices their positions in a step
        of their own. A fetch allocates their HBM blocks and makes the request wait, as a
        received KV does (scheduler Rule 6); either way is decided once per admission and
        counted (blocks, bytes, seconds; tokens recomputed instead).
Rule 4: a tier counts in whole blocks of the full-attention layers (``block_bytes``);
        windowed and recurrent state is recomputed, not offloaded.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from inference_lab.core.config import Deployment
from inference_lab.core.engine.block_pool import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from inference_lab.core.engine.kv_cache_manager import KVCacheManager
from inference_lab.core.engine.outputs import TierStatistics
from inference_lab.core.engine.request import Request
from inference_lab.core.roofline import Roofline

__all__ = ["KVTier", "TierStack"]


class KVTier:
    """One tier: block hashes in least-recently-used order, at most ``capacity``
    (Rule 2)."""

    __slots__ = ("medium", "capacity", "blocks")

    def __init__(self, medium: str, capacity: int) -> None:
        self.medium = medium
        self.capacity = capacity
        #: hash -> None, least recently used first (an OrderedDict: popping its oldest is
        #: O(1), where a dict's first key is found past the slots its pops left behind)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def put(self, h: int) -> int | None:
        """Keep ``h`` (most recently used); the hash it pushed out, if any."""
        blocks = self.blocks
        if h in blocks:
            blocks.move_to_end(h)
            return None
        blocks[h] = None
        if len(blocks) > self.capacity:
            return blocks.popitem(last=False)[0]
        return None

    def touch(self, h: int) -> None:
        self.blocks.move_to_end(h)


class TierStack:
    """A worker's tiers behind its HBM (Rules 1-4)."""

    def __init__(
        self,
        dep: Deployment,
        roofline: Roofline,
        kv: KVCacheManager,
        worker: int,
        events: list[KVEvent] | None,
    ) -> None:
        sched = dep.scheduler
        host = dep.profile.host
        assert host is not None  # the loader checks a host tier has a [host] link
        self.block_bytes = dep.block_bytes
        self.block_size = sched.block_size
        self.host = KVTier(
            MEDIUM_CPU, math.floor(sched.kv_offloading_size * 2**30 / self.block_bytes)
        )
        disk = math.floor(sched.kv_offloading_disk_size * 2**30 / self.block_bytes)
        self.disk = KVTier(MEDIUM_DISK, disk) if disk else None
        self.host_bandwidth = host.bandwidth * dep.hardware.tp
        self.host_latency = host.latency
        self.disk_bandwidth = sched.kv_offloading_disk_bandwidth
        self.disk_latency = sched.kv_offloading_disk_latency
        self.roofline = roofline
        self.kv = kv
        self.worker = worker
        self.events = events
        self.host_hit_tokens = 0
        self.disk_hit_tokens = 0
        self.fetches = 0
        self.fetch_bytes = 0.0
        self.fetch_seconds_total = 0.0
        self.recomputed_tokens = 0
        self.host_stores = 0
        self.disk_stores = 0
        kv.pool.spill = self.spill

    # ------------------------------------------------------------------ Rule 1
    def spill(self, hashes: list[int]) -> None:
        """HBM evicted ``hashes``: into the host tier, its overflow into the disk tier."""
        stored: list[int] = []
        down: list[int] = []
        for h in hashes:
            if h not in self.host.blocks:
                stored.append(h)
            out = self.host.put(h)
            if out is not None:
                down.append(out)
        self.host_stores += len(stored)
        self._event(BlockStored, stored, MEDIUM_CPU)
        self._event(BlockRemoved, down, MEDIUM_CPU)
        if not down or self.disk is None:
            return
        stored, dropped = [], []
        for h in down:
            if h not in self.disk.blocks:
                stored.append(h)
            out = self.disk.put(h)
            if out is not None:
                dropped.append(out)
        self.disk_stores += len(stored)
        self._event(BlockStored, stored, MEDIUM_DISK)
        self._event(BlockRemoved, dropped, MEDIUM_DISK)

    def _event(
        self, kind: type[BlockStored] | type[BlockRemoved], hashes: list[int], medium: str
    ) -> None:
        if not hashes or self.events is None:
            return
        if kind is BlockStored:
            self.events.append(
                BlockStored(
                    worker=self.worker,
                    block_hashes=tuple(hashes),
                    parent_block_hash=None,
                    medium=medium,
                )
            )
        else:
            self.events.append(
                BlockRemoved(worker=self.worker, block_hashes=tuple(hashes), medium=medium)
            )

    # ------------------------------------------------------------------ Rule 3
    def plan(self, r: Request) -> None:
        """Decide, once for this admission, whether ``r`` fetches the blocks of its chain
        the tiers hold past its HBM hit: if so, set its remote positions and its fetch
        (blocks from the host, from the disk, seconds); count either way."""
        r.tier_checked = True
        hit, _ = self.kv.computed_blocks(r)
        if r.n == 1 and r.num_output:
            limit = r.prompt_tokens + r.num_output - 1
        else:
            limit = r.prompt_tokens - 1
        limit = min(r.cacheable_blocks, limit // self.block_size)
        hashes = r.block_hashes
        host, disk = self.host.blocks, self.disk.blocks if self.disk is not None else {}
        n_host = n_disk = 0
        i = hit
        while i < limit:
            h = hashes[i]
            if h in host:
                n_host += 1
            elif h in disk:
                n_disk += 1
            else:
                break
            i += 1
        if not n_host and not n_disk:
            return
        bs = self.block_size
        fetch = self.fetch_seconds(n_host, n_disk)
        rf = self.roofline
        positions = (n_host + n_disk) * bs
        compute = rf.price(rf.batch_terms([positions], [hit * bs])).seconds
        if fetch >= compute:
            self.recomputed_tokens += positions
            return
        for h in hashes[hit:i]:
            if h in host:
                self.host.touch(h)
            elif self.disk is not None:
                self.disk.touch(h)
        self.host_hit_tokens += n_host * bs
        self.disk_hit_tokens += n_disk * bs
        r.remote_positions = i * bs
        r.tier_fetch = (n_host, n_disk, fetch)

    def fetch_seconds(self, n_host: int, n_disk: int) -> float:
        """Rule 3's price of fetching ``n_host`` blocks from the host tier and ``n_disk``
        from the disk tier."""
        seconds = 0.0
        if n_host:
            seconds += self.host_latency + n_host * self.block_bytes / self.host_bandwidth
        if n_disk:
            moved = n_disk * self.block_bytes
            seconds += self.disk_latency + moved / self.disk_bandwidth
            seconds += self.host_latency + moved / self.host_bandwidth
        return seconds

    def fetched(self, r: Request) -> tuple[float, float]:
        """``r`` starts the fetch it planned: its bytes and seconds, counted."""
        assert r.tier_fetch is not None
        n_host, n_disk, seconds = r.tier_fetch
        moved = (n_host + n_disk) * self.block_bytes
        self.fetches += 1
        self.fetch_bytes += moved
        self.fetch_seconds_total += seconds
        return moved, seconds

    def statistics(self) -> TierStatistics:
        disk = self.disk
        return TierStatistics(
            host_blocks=len(self.host.blocks),
            disk_blocks=0 if disk is None else len(disk.blocks),
            host_capacity=self.host.capacity,
            disk_capacity=0 if disk is None else disk.capacity,
            host_hit_tokens=self.host_hit_tokens,
            disk_hit_tokens=self.disk_hit_tokens,
            fetches=self.fetches,
            fetch_bytes=self.fetch_bytes,
            fetch_seconds=self.fetch_seconds_total,
            recomputed_tokens=self.recomputed_tokens,
            host_stores=self.host_stores,
            disk_stores=self.disk_stores,
        )
