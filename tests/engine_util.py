"""Helpers for engine tests: small deployments built from the shipped configs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import attrs

from inference_lab.core.config import Deployment, load_deployment
from inference_lab.core.engine import Engine, Finished, RequestSpec, StepEvents
from inference_lab.core.engine.block_pool import NOT_CACHED

ROOT = Path(__file__).resolve().parent.parent
LLAMA8B = ROOT / "configs" / "Llama-3.1-8B-Instruct.toml"
GPT_OSS_20B = ROOT / "configs" / "gpt-oss-20b.toml"
DEEPSEEK_V3 = ROOT / "configs" / "frontier" / "DeepSeek-V3.toml"


def deployment(
    config: Path = LLAMA8B,
    hardware: str = "b200",
    *,
    blocks: int | None = None,
    replicas: int | None = None,
    router: str | None = None,
    **scheduler: Any,
) -> Deployment:
    """A shipped deployment with scheduler keys overridden; ``blocks`` sets the KV cache to
    exactly that many blocks per replica (via kv_cache_capacity)."""
    dep = load_deployment(config, hardware)
    sched = attrs.evolve(dep.scheduler, **scheduler)
    dep = attrs.evolve(dep, scheduler=sched)
    if blocks is not None:
        sched = attrs.evolve(sched, kv_cache_capacity=blocks * dep.block_bytes)
        dep = attrs.evolve(dep, scheduler=sched)
    hw = dep.hardware
    if replicas is not None:
        hw = attrs.evolve(hw, replicas=replicas)
    if router is not None:
        hw = attrs.evolve(hw, router=router)
    return attrs.evolve(dep, hardware=hw)


def run(engine: Engine, until: float | None = None) -> list[StepEvents]:
    """Step until no event is left (or the next is later than ``until``)."""
    out = []
    while True:
        t = engine.next_event_time()
        if t is None or (until is not None and t > until):
            return out
        out.append(engine.step())


def finished(events: list[StepEvents]) -> dict[int, Finished]:
    return {f.request_id: f for ev in events for f in ev.finished}


def tokens_by_request(events: list[StepEvents]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for ev in events:
        for rid, n in ev.tokens:
            counts[rid] = counts.get(rid, 0) + n
    return counts


def spec(prompt: int, max_tokens: int, **kw: Any) -> RequestSpec:
    return RequestSpec(prompt_tokens=prompt, max_tokens=max_tokens, **kw)


def assert_blocks_conserved(engine: Engine) -> None:
    """Rule 4 of the engine (Rule 1 of its KV cache): on every worker, the free blocks
    (empty or evictable cached ones) plus the running requests' own blocks plus the cached
    blocks they hold equal the total; each cached block's reference count is the number of
    running requests holding it, and exactly the unreferenced ones are evictable; a
    request's cached blocks are a prefix of its hash chain; each running member of the
    step in flight holds exactly the blocks of the positions it has once that step ends
    (no more, no fewer). Without cached blocks this is free + held == total. Requests
    receiving a remote prefill's KV or holding theirs for a remote decode (scheduler Rule
    6) hold blocks as running ones do; a request back in the queue after receiving holds
    the blocks it received."""
    for w in engine.workers:
        w.sync_running()  # the fast path's rows hold the running requests' counts
        pool = w.pool
        holders = [*w.running, *w.receiving, *w.held.values()]
        holders += [r for r in w.waiting if r.num_blocks]
        own = sum(r.num_blocks - len(r.held_hashes) for r in holders)
        referenced = {h: c for h, c in pool.ref.items() if c > 0}
        assert w.free_blocks + own + len(referenced) == w.total_blocks, (
            w.free_blocks,
            own,
            len(referenced),
            w.total_blocks,
        )
        assert w.free_blocks >= 0
        assert referenced == Counter(h for r in holders for h in r.held_hashes)
        assert set(pool.evictable) == {h for h, c in pool.ref.items() if c == 0}
        assert len(pool.evictable) <= w.free_blocks
        assert pool.filling == sum(1 for r in holders if r.next_cache_position != NOT_CACHED)
        for r in holders:
            assert tuple(r.held_hashes) == r.block_hashes[: len(r.held_hashes)], r.id
            assert r.num_blocks >= len(r.held_hashes)
        for r in w.waiting:
            if not r.num_blocks:
                assert not r.held_hashes, r.id
        for r, n in w.batch:
            if r in w.running:
                assert r.num_blocks == w.kv.group_blocks(r, r.num_computed + n), (
                    r.id,
                    r.num_blocks,
                )
