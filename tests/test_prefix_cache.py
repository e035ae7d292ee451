"""Prefix caching in the engine: the block pool, the KV cache manager and the scheduler
asking them (``core/engine/block_pool.py``, ``core/engine/kv_cache_manager.py``; engine
Rule 4).

Hashes here are plain integers: the engine treats a chain as opaque, and two requests
share block ``i`` exactly when their first ``i + 1`` hashes are equal.
"""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_lab.core.engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Engine,
    RequestSpec,
    StepEvents,
)
from tests.engine_util import (
    assert_blocks_conserved,
    deployment,
    finished,
    run,
    spec,
    tokens_by_request,
)

BS = 16  # Llama-3.1-8B's block size


def chain(prefix: str, count: int, start: int = 0) -> tuple[int, ...]:
    """``count`` distinct hashes named by ``prefix`` (blocks start..start+count-1)."""
    return tuple(hash((prefix, i)) & (2**62 - 1) for i in range(start, start + count))


def run_checked(engine: Engine) -> list[StepEvents]:
    """Step until idle, checking block conservation after every event."""
    out = []
    while engine.next_event_time() is not None:
        out.append(engine.step())
        assert_blocks_conserved(engine)
    return out


def steps_of(events: list[StepEvents]) -> list[tuple[int, float]]:
    return [(ev.step.num_tokens, ev.step.duration) for ev in events if ev.step is not None]


# ------------------------------------------------------------------ exact hit accounting


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(4, 40), st.booleans())
def test_hit_accounting_is_exact_with_an_unbounded_cache(
    seed: int, count: int, chunked_cap: bool
) -> None:
    """Requests arriving one after another (each after the previous one finished) on a
    cache that never evicts: every request's cached tokens equal a count made from the
    hashes alone — its leading hashes among the blocks earlier requests computed, capped
    at (P - 1) // block_size blocks — and the steps computed exactly P - cached + target
    - 1 positions for it; the counters sum the same numbers."""
    rng = np.random.default_rng(seed)
    eng = Engine(deployment(long_prefill_token_threshold=48 if chunked_cap else 0))
    fresh = itertools.count(1)
    chains: list[tuple[int, ...]] = []
    computed: set[int] = set()  # hashes of every block some request has computed
    expected_hits = queries = 0
    for _ in range(count):
        prompt = int(rng.integers(1, 400))
        target = int(rng.integers(1, 40))
        length = int(rng.integers(0, (prompt + target) // BS + 2))
        if chains and rng.random() < 0.8:  # share a prefix with an earlier request
            parent = chains[int(rng.integers(len(chains)))]
            shared = int(rng.integers(0, len(parent) + 1))
            hashes = parent[:shared] + tuple(next(fresh) for _ in range(length - shared))
            hashes = hashes[:length]
        else:
            hashes = tuple(next(fresh) for _ in range(length))
        chains.append(hashes)
        k = 0
        while k < min(len(hashes), (prompt - 1) // BS) and hashes[k] in computed:
            k += 1
        eng.advance_to(eng.now + 1.0)
        rid = eng.submit(spec(prompt, target, block_hashes=hashes))
        events = run_checked(eng)
        f = finished(events)[rid]
        assert f.cached_tokens == k * BS, (prompt, hashes, computed)
        assert sum(n for n, _ in steps_of(events)) == prompt - k * BS + target - 1
        assert tokens_by_request(events) == {rid: target}
        computed.update(hashes[: (prompt + target - 1) // BS])
        expected_hits += k * BS
        queries += prompt
    stats = eng.statistics()
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (expected_hits, queries)
    assert stats.cached_blocks == len(computed)


def test_the_last_prompt_token_is_always_computed() -> None:
    """A prompt of exactly four cached blocks finds only three: its last block holds the
    last prompt token, which is computed to emit token 1."""
    eng = Engine(deployment())
    hashes = chain("p", 4)
    eng.submit(spec(64, 1, block_hashes=hashes))
    run(eng)
    rid = eng.submit(spec(64, 1, block_hashes=hashes))
    events = run(eng)
    assert finished(events)[rid].cached_tokens == 48
    assert steps_of(events)[0][0] == 16


# ------------------------------------------------------------------ LRU eviction


def test_lru_eviction_order_with_a_tiny_cache_step_by_step() -> None:
    """Eight blocks of 16 tokens. A finished request's full blocks stay cached and count as
    free; they are given back tail first; allocations take empty blocks before evicting,
    then evict the least recently freed; a hit takes its blocks out of the queue."""
    eng = Engine(deployment(blocks=8), record_kv_events=True)
    pool = eng.workers[0].pool
    a, b, c = chain("a", 3), chain("b", 3), chain("c", 4)

    def serve(prompt: int, hashes: tuple[int, ...]) -> tuple[int, list[object]]:
        eng.advance_to(eng.now + 1.0)
        rid = eng.submit(spec(prompt, 1, block_hashes=hashes))
        f = finished(run_checked(eng))[rid]
        return f.cached_tokens, list(eng.take_kv_events())

    # A: three blocks, cached as computed, freed tail first
    assert serve(48, a) == (0, [BlockStored(worker=0, block_hashes=a, parent_block_hash=None)])
    assert list(pool.evictable) == [a[2], a[1], a[0]]
    assert eng.workers[0].free_blocks == 8
    # B takes three of the five empty blocks: nothing is evicted
    assert serve(48, b)[1] == [BlockStored(worker=0, block_hashes=b, parent_block_hash=None)]
    assert list(pool.evictable) == [a[2], a[1], a[0], b[2], b[1], b[0]]
    # C needs four: the two empty ones, then the two least recently freed (A's tail)
    cached, events = serve(64, c)
    assert cached == 0
    assert events == [
        BlockRemoved(worker=0, block_hashes=(a[2], a[1])),
        BlockStored(worker=0, block_hashes=c, parent_block_hash=None),
    ]
    assert list(pool.evictable) == [a[0], b[2], b[1], b[0], c[3], c[2], c[1], c[0]]
    # D shares A's first block only (A's second was evicted): it hits one block, which
    # leaves the queue while D holds it, and evicts the two oldest for its own two
    d = (a[0], *chain("d", 2, start=1))
    cached, events = serve(48, d)
    assert cached == 16
    assert events == [
        BlockRemoved(worker=0, block_hashes=(b[2], b[1])),
        BlockStored(worker=0, block_hashes=d[1:], parent_block_hash=a[0]),
    ]
    assert list(pool.evictable) == [b[0], c[3], c[2], c[1], c[0], d[2], d[1], d[0]]
    # B again: only its first block survived
    cached, events = serve(48, b)
    assert cached == 16
    assert events == [
        BlockRemoved(worker=0, block_hashes=(c[3], c[2])),
        BlockStored(worker=0, block_hashes=b[1:], parent_block_hash=b[0]),
    ]
    assert list(pool.evictable) == [c[1], c[0], d[2], d[1], d[0], b[2], b[1], b[0]]
    assert eng.statistics().kv_used_blocks == 0 and eng.workers[0].free_blocks == 8


def test_a_request_that_needs_every_block_evicts_the_whole_cache() -> None:
    """Cached blocks never stand in the way of an allocation: a request needing all eight
    blocks runs after others filled the cache, evicting every one of them."""
    eng = Engine(deployment(blocks=8))
    eng.submit(spec(64, 1, block_hashes=chain("x", 4)))
    eng.submit(spec(64, 1, block_hashes=chain("y", 4), arrival_time=1.0))
    run_checked(eng)
    assert eng.workers[0].pool.cached_blocks == 8
    rid = eng.submit(spec(100, 28, arrival_time=2.0))
    f = finished(run_checked(eng))[rid]
    assert f.output_tokens == 28 and f.preemptions == 0
    assert eng.workers[0].pool.cached_blocks == 0


# ------------------------------------------------------------------ pricing


def test_a_cached_prefix_is_not_computed_but_attention_reads_it() -> None:
    """Llama-3.1-8B on B200, a 4000-token prompt whose first 3200 tokens are cached: the
    first step computes 800 positions (weights' FLOPs for 800 tokens) while attention
    attends 3200 + 400 positions, by hand: 2 * 8.03e9 * 800 weight FLOPs plus 32 layers
    * 4 * 32 heads * 128 * 800 * 3600 attention FLOPs at 2.25e15 FLOP/s (compute-bound)."""
    eng = Engine(deployment())
    hashes = chain("long", 250)
    eng.submit(spec(3201, 1, block_hashes=hashes))  # caches 200 blocks (3200 tokens)
    run(eng)
    rid = eng.submit(spec(4000, 1, block_hashes=hashes, arrival_time=1.0))
    events = run(eng)
    assert finished(events)[rid].cached_tokens == 3200
    ((tokens, duration),) = steps_of(events)
    weight_flops = 2 * 8.03e9 * 800
    attention_flops = 32 * 4 * 32 * 128 * 800 * (3200 + 400)
    weight_bytes = 2 * 8.03e9
    kv_bytes = 32 * (2 * 8 * 128 * 2) * (3200 + 400)
    compute = (weight_flops + attention_flops) / 2.25e15
    memory = (weight_bytes + kv_bytes) / 8.0e12
    assert compute > memory
    assert tokens == 800
    assert duration == pytest.approx(compute, rel=1e-12)
    # without the cache the same prompt computes all 4000 positions
    cold = Engine(deployment())
    ((cold_tokens, cold_duration),) = steps_of(run(_submitted(cold, spec(4000, 1))))
    assert cold_tokens == 4000
    assert cold_duration == pytest.approx(
        (2 * 8.03e9 * 4000 + 32 * 4 * 32 * 128 * 4000 * 2000) / 2.25e15, rel=1e-12
    )


def _submitted(engine: Engine, *specs: RequestSpec) -> Engine:
    for s in specs:
        engine.submit(s)
    return engine


def test_a_late_arrival_joins_the_step_priced_with_its_cached_prefix() -> None:
    """A request stamped 1 us before the boundary of a step in flight but handed over
    after it, with 160 of its 170 tokens cached, joins that step: the step is priced again
    with it as 10 positions on top of a context of 160, and it finishes at that end."""
    hashes = chain("late", 10)
    eng = Engine(deployment())
    eng.submit(spec(161, 1, block_hashes=hashes))
    run(eng)
    t0 = eng.now + 1.0
    eng.submit(spec(40, 30, arrival_time=t0))
    run(eng, until=t0)  # the step starting at t0 is in flight
    rid = eng.submit(spec(170, 1, block_hashes=hashes, arrival_time=t0 - 1e-6))
    f = finished(run_checked(eng))[rid]
    assert f.cached_tokens == 160
    expected = eng.roofline.step_time(np.array([40, 10]), np.array([0, 160]))
    assert f.first_scheduled_time == t0
    assert f.finish_time == pytest.approx(t0 + expected, rel=1e-12)


# ------------------------------------------------------------------ exactness when off


def _events(engine: Engine) -> list[tuple[object, ...]]:
    return [(ev.time, ev.tokens, ev.finished, ev.arrived, ev.step) for ev in run(engine)]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 60), st.floats(0, 0.3)),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 2),
)
def test_without_hashes_or_with_caching_off_nothing_changes(
    reqs: list[tuple[int, int, float]], replicas: int
) -> None:
    """The same workload gives identical events (times, tokens, finishes, steps) with
    prefix caching on and no hashes, and with caching off and hashes: the cache is
    invisible until a request carries hashes and caching is on."""
    dep = deployment(blocks=30, replicas=replicas, max_num_batched_tokens=256)
    off = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, enable_prefix_caching=False))
    plain = Engine(dep)
    hashed_off = Engine(off)
    reference = Engine(off)
    for prompt, mt, t in reqs:
        hashes = chain("same", (prompt + mt) // BS)
        plain.submit(spec(prompt, mt, arrival_time=t))
        hashed_off.submit(spec(prompt, mt, arrival_time=t, block_hashes=hashes))
        reference.submit(spec(prompt, mt, arrival_time=t))
    ref = _events(reference)
    assert _events(plain) == ref
    assert _events(hashed_off) == ref
    assert hashed_off.statistics().prefix_cache_queries == 0
    assert hashed_off.statistics().cached_blocks == 0


# ------------------------------------------------------------------ scheduler features


def test_a_preempted_request_hits_its_own_blocks_when_readmitted() -> None:
    """Ten blocks, two requests growing to seven each: the later one is preempted; its
    computed blocks stay cached, so its re-admission recomputes only what is not cached.
    Every step conserves blocks; both finish with every token, emitted once."""
    eng = Engine(deployment(blocks=10))
    a = eng.submit(spec(64, 48, block_hashes=chain("a", 7)))
    b = eng.submit(spec(64, 48, block_hashes=chain("b", 7)))
    events = run_checked(eng)
    fin = finished(events)
    assert fin[b].preemptions >= 1
    assert tokens_by_request(events) == {a: 48, b: 48}
    stats = eng.statistics()
    assert stats.prefix_cache_hits > 0  # the re-admission found its own blocks
    # a preemption without the cache recomputes more
    cold = Engine(deployment(blocks=10))
    cold.submit(spec(64, 48))
    cold.submit(spec(64, 48))
    cold_positions = sum(ev.step.num_tokens for ev in run(cold) if ev.step)
    positions = sum(ev.step.num_tokens for ev in events if ev.step)
    assert positions == cold_positions - stats.prefix_cache_hits
    assert eng.workers[0].free_blocks == 10


def test_a_fully_cached_readmission_decodes_at_once() -> None:
    """Seven 16-token blocks, two 32-token prompts growing to 62 positions: the later one
    is preempted after 17 tokens (48 positions resident, three full blocks, all cached).
    Re-admitted, it finds all 48 cached (P + output - 1) and its first step is one
    decode position that emits its 18th token: nothing is recomputed."""
    eng = Engine(deployment(blocks=7))
    a = eng.submit(spec(32, 30, block_hashes=chain("a", 8)))
    b = eng.submit(spec(32, 30, block_hashes=chain("b", 8)))
    w = eng.workers[0]
    readmitted = None
    emitted = 0
    events = []
    while eng.next_event_time() is not None:
        ev = eng.step()
        events.append(ev)
        assert_blocks_conserved(eng)
        emitted += sum(n for rid, n in ev.tokens if rid == b)
        rb = eng._requests.get(b)
        if readmitted is None and rb is not None and rb.preemptions and ev.step is not None:
            mine = [(r.num_computed, n) for r, n in w.batch if r is rb]
            if mine:
                readmitted = (rb.num_output, *mine[0], emitted)
        elif readmitted is not None and len(readmitted) == 4:
            readmitted = (*readmitted, sum(n for rid, n in ev.tokens if rid == b))
    assert readmitted == (17, 48, 1, 17, 1)  # output 17, 48 cached, one position, +1 token
    assert tokens_by_request(events) == {a: 30, b: 30}


@pytest.mark.parametrize("threshold", [0, 48])
def test_chunked_prefill_starts_after_the_cached_prefix(threshold: int) -> None:
    """With a chunk cap, a request with 160 cached tokens of 300 prefills the other 140
    in chunks of the cap (or one step without a cap); token 1 comes at the end of the
    last chunk."""
    eng = Engine(deployment(long_prefill_token_threshold=threshold))
    hashes = chain("chunk", 18)
    eng.submit(spec(161, 1, block_hashes=hashes))
    run(eng)
    rid = eng.submit(spec(300, 3, block_hashes=hashes, arrival_time=1.0))
    events = run_checked(eng)
    sizes = [n for n, _ in steps_of(events)]
    assert finished(events)[rid].cached_tokens == 160
    assert sizes == ([48, 48, 44, 1, 1] if threshold else [140, 1, 1])
    first_token = next(ev.time for ev in events if ev.tokens)
    assert first_token == events[-1].time - sum(d for _, d in steps_of(events)[-2:])


def test_disabled_chunked_prefill_needs_room_only_for_the_uncached_part() -> None:
    """Without chunked prefill a prefill runs whole or waits: of two 200-token prompts
    arriving together under a 256-token budget the second waits for the next step, unless
    192 of its tokens are cached: its 8 others then fit beside the first."""
    firsts = []
    for cached in (False, True):
        eng = Engine(deployment(enable_chunked_prefill=False, max_num_batched_tokens=256))
        hashes = chain("nochunk", 13)
        if cached:
            eng.submit(spec(193, 1, block_hashes=hashes))
            run(eng)
        t = eng.now + 1.0
        a = eng.submit(spec(200, 2, arrival_time=t))
        b = eng.submit(spec(200, 2, block_hashes=hashes, arrival_time=t))
        fin = finished(run_checked(eng))
        assert fin[b].cached_tokens == (192 if cached else 0)
        firsts.append(fin[b].first_scheduled_time - fin[a].first_scheduled_time)
    assert firsts[0] > 0
    assert firsts[1] == 0


def test_a_group_shares_its_cached_prompt_and_caches_only_full_prompt_blocks() -> None:
    """n = 3 with a chain over its prompt and outputs: it finds the prompt prefix an
    earlier request cached, caches only its full prompt blocks (its sequences' outputs
    differ), and a later plain request hits them."""
    eng = Engine(deployment(blocks=100))
    hashes = chain("group", 12)
    eng.submit(spec(49, 1, block_hashes=hashes))  # caches 3 blocks
    run(eng)
    g = eng.submit(spec(100, 20, n=3, block_hashes=hashes, arrival_time=1.0))
    events = run_checked(eng)
    f = finished(events)[g]
    assert (f.cached_tokens, f.output_tokens, f.n) == (48, 20, 3)
    assert eng.workers[0].pool.cached_blocks == 100 // BS  # 6 prompt blocks, no output
    later = eng.submit(spec(120, 1, block_hashes=hashes, arrival_time=eng.now + 1))
    assert finished(run_checked(eng))[later].cached_tokens == 96


def test_abort_gives_back_cached_and_own_blocks() -> None:
    """Aborting a running request that holds cached blocks (shared with another running
    request) returns its own blocks and drops its references; the blocks stay cached."""
    eng = Engine(deployment(blocks=40))
    hashes = chain("abort", 10)
    eng.submit(spec(129, 1, block_hashes=hashes))
    run(eng)
    a = eng.submit(spec(140, 50, block_hashes=hashes, arrival_time=1.0))
    b = eng.submit(spec(140, 50, block_hashes=hashes, arrival_time=1.0))
    while eng.now < 1.0 or eng.statistics().running < 2:
        eng.step()
    assert_blocks_conserved(eng)
    pool = eng.workers[0].pool
    assert pool.ref[hashes[0]] == 2
    assert eng.abort(a)
    assert_blocks_conserved(eng)
    assert pool.ref[hashes[0]] == 1
    events = run_checked(eng)
    assert tokens_by_request(events)[b] == 50
    assert eng.workers[0].free_blocks == 40 and pool.cached_blocks >= 8


def test_identical_concurrent_prefills_keep_one_cached_copy() -> None:
    """Two requests with the same chain admitted in the same step both compute the
    prefix; when their blocks fill, the second's copies go back to the pool and it holds
    the first's: the pool ends with one cached block per hash."""
    eng = Engine(deployment(blocks=40))
    hashes = chain("twin", 6)
    a = eng.submit(spec(100, 5, block_hashes=hashes))
    b = eng.submit(spec(100, 5, block_hashes=hashes))
    events = run_checked(eng)
    fin = finished(events)
    assert fin[a].cached_tokens == fin[b].cached_tokens == 0
    assert eng.workers[0].pool.cached_blocks == 6
    assert eng.workers[0].free_blocks == 40


def test_lowering_max_num_seqs_with_cached_blocks_drains_and_keeps_the_cache() -> None:
    """Lowering the cap never evicts running requests that hold cached blocks; the
    waiting ones are admitted (hitting the cache) as the cap allows."""
    eng = Engine(deployment(max_num_seqs=4))
    hashes = chain("cap", 8)
    eng.submit(spec(129, 1, block_hashes=hashes))
    run(eng)
    ids = [eng.submit(spec(130, 20, block_hashes=hashes, arrival_time=1.0)) for _ in range(4)]
    while eng.statistics().running < 4:
        eng.step()
    eng.set_max_num_seqs(1)
    late = eng.submit(spec(130, 5, block_hashes=hashes, arrival_time=eng.now))
    peak_after = 0
    events = []
    while eng.next_event_time() is not None:
        events.append(eng.step())
        assert_blocks_conserved(eng)
        peak_after = max(peak_after, eng.statistics().running)
    fin = finished(events)
    assert all(fin[i].output_tokens == 20 for i in ids)
    assert fin[late].cached_tokens == 128
    assert fin[late].first_scheduled_time >= max(fin[i].finish_time for i in ids)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 300),  # prompt
            st.integers(1, 60),  # max_tokens
            st.floats(0, 0.5),  # arrival
            st.integers(0, 3),  # which shared chain
            st.integers(1, 3),  # n
            st.booleans(),  # abort at some point
        ),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from(["fcfs", "priority", "sjf"]),
    st.sampled_from(["round_robin", "least_loaded", "prefix_affinity", "kv_aware"]),
    st.integers(0, 2**31),
)
def test_blocks_are_conserved_with_shared_prefixes_over_random_runs(
    reqs: list[tuple[int, int, float, int, int, bool]], policy: str, router: str, seed: int
) -> None:
    """With requests sharing prefixes of four chains on a small cache (admissions, hits,
    evictions, preemptions, groups, chunking, aborts, several replicas): blocks are
    conserved and reference counts exact after every event; at the end every block is
    free (cached or empty) and every request finished with its length or was aborted."""
    rng = np.random.default_rng(seed)
    eng = Engine(
        deployment(
            policy=policy,
            blocks=60,
            replicas=int(rng.integers(1, 4)),
            router=router,
            max_num_batched_tokens=256,
            long_prefill_token_threshold=int(rng.integers(0, 100)),
        )
    )
    chains = [chain(f"c{i}", 30) for i in range(4)]
    ids = []
    for prompt, mt, arrival, which, n, _ in reqs:
        length = int(rng.integers(0, (prompt + mt) // BS + 2))
        ids.append(
            eng.submit(
                spec(prompt, mt, arrival_time=arrival, n=n, block_hashes=chains[which][:length])
            )
        )
    aborts = {rid for rid, r in zip(ids, reqs, strict=True) if r[5]}
    emitted: dict[int, int] = {}
    fin = {}
    while eng.next_event_time() is not None:
        ev = eng.step()
        for rid, k in ev.tokens:
            emitted[rid] = emitted.get(rid, 0) + k
        for f in ev.finished:
            fin[f.request_id] = f
        assert_blocks_conserved(eng)
        if aborts and rng.random() < 0.2:
            eng.abort(aborts.pop())
            assert_blocks_conserved(eng)
    for w in eng.workers:
        assert w.free_blocks == w.total_blocks
        assert len(w.pool.evictable) == w.pool.cached_blocks
    for rid, (_p, mt, *_rest) in zip(ids, reqs, strict=True):
        if rid in fin:
            assert fin[rid].output_tokens == mt == emitted[rid]
        else:
            assert emitted.get(rid, 0) < mt
    assert eng.is_idle()


# ------------------------------------------------------------------ routers


def test_prefix_affinity_sends_a_request_where_its_longest_prefix_is_cached() -> None:
    """prefix_affinity on three replicas: three simultaneous cold arrivals spread over the
    replicas (the load bound); a later request sharing the prefixes of two of them goes
    to the replica holding the longer one."""
    eng = Engine(deployment(replicas=3, router="prefix_affinity"))
    x, y = chain("x", 10), chain("y", 4)
    cold = [
        eng.submit(spec(33, 1, block_hashes=x[:2])),
        eng.submit(spec(65, 1, block_hashes=y)),
        eng.submit(spec(65, 1, block_hashes=x[:4])),
    ]
    fin = finished(run(eng))
    assert [fin[r].worker for r in cold] == [0, 1, 2]
    rid = eng.submit(spec(150, 1, block_hashes=x, arrival_time=1.0))
    f = finished(run(eng))[rid]
    assert (f.worker, f.cached_tokens) == (2, 64)


def test_prefix_affinity_falls_back_when_the_cached_replica_is_at_the_bound() -> None:
    """Requests follow their cached prefix to replica 0 while its load (running +
    waiting) stays below ceil(1.25 * (total + 1) / 2); the third of three simultaneous
    ones finds replica 0 at the bound (2 of 2) and goes to replica 1."""
    eng = Engine(deployment(replicas=2, router="prefix_affinity"))
    x = chain("x", 10)
    warm = eng.submit(spec(65, 1, block_hashes=x[:4]))
    assert finished(run(eng))[warm].worker == 0
    ids = [eng.submit(spec(150, 50, block_hashes=x, arrival_time=1.0)) for _ in range(3)]
    fin = finished(run(eng))
    assert [(fin[r].worker, fin[r].cached_tokens) for r in ids] == [(0, 64), (0, 64), (1, 0)]


@pytest.mark.parametrize(("queued", "expected"), [(False, 0), (True, 1)])
def test_kv_aware_weighs_uncached_tokens_against_queued_prefill(
    queued: bool, expected: int
) -> None:
    """kv_aware (weight 1): cost = uncached prompt tokens + queued prefill tokens. A
    150-token request with 64 tokens cached on replica 0 costs 86 there against 150 on the
    idle replica 1; with a 1000-token prefill waiting on replica 0 it costs 1086 there,
    so it goes to replica 1."""
    eng = Engine(deployment(replicas=2, router="kv_aware"))
    x = chain("x", 10)
    warm = eng.submit(spec(65, 1, block_hashes=x[:4]))
    assert finished(run(eng))[warm].worker == 0
    if queued:  # 936 uncached tokens on replica 0 against 1000 on replica 1
        eng.submit(spec(1000, 5, block_hashes=x[:4], arrival_time=1.0))
        eng.step()
        assert eng.workers[0].queued_prefill() == 1000
    rid = eng.submit(spec(150, 1, block_hashes=x, arrival_time=1.0))
    assert finished(run(eng))[rid].worker == expected


def test_router_options_are_read_from_the_hardware_entry() -> None:
    """affinity_load_ratio widens the bound: at 3.0 all three requests of the fallback
    case above stay on the replica with the prefix."""
    dep = deployment(replicas=2, router="prefix_affinity")
    dep = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, affinity_load_ratio=3.0))
    eng = Engine(dep)
    x = chain("x", 10)
    eng.submit(spec(65, 1, block_hashes=x[:4]))
    run(eng)
    ids = [eng.submit(spec(150, 50, block_hashes=x, arrival_time=1.0)) for _ in range(3)]
    fin = finished(run(eng))
    assert [fin[r].worker for r in ids] == [0, 0, 0]


# ------------------------------------------------------------------ events, reset


def test_kv_events_rebuild_the_cache_state() -> None:
    """A subscriber applying every stored / removed / cleared event reproduces each
    worker's set of cached hashes at every step, over a run with evictions on two
    replicas; parents name the previous block of the chain."""
    eng = Engine(deployment(blocks=24, replicas=2, router="prefix_affinity"), record_kv_events=True)
    rng = np.random.default_rng(3)
    chains = [chain(f"e{i}", 20) for i in range(3)]
    for i in range(40):
        c = chains[int(rng.integers(3))]
        prompt = int(rng.integers(20, 200))
        eng.submit(spec(prompt, 8, arrival_time=i * 0.01, block_hashes=c[: prompt // BS + 1]))
    seen: list[set[int]] = [set(), set()]
    removed = 0
    while eng.next_event_time() is not None:
        eng.step()
        for ev in eng.take_kv_events():
            if isinstance(ev, BlockStored):
                assert not seen[ev.worker] & set(ev.block_hashes)
                if ev.parent_block_hash is not None:
                    assert ev.parent_block_hash in seen[ev.worker]
                seen[ev.worker].update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= seen[ev.worker]
                seen[ev.worker].difference_update(ev.block_hashes)
                removed += 1
            else:
                seen[ev.worker].clear()
        for w in eng.workers:
            assert seen[w.index] == set(w.pool.ref)
    assert removed > 0
    assert eng.reset_prefix_cache()
    assert eng.take_kv_events() == (AllBlocksCleared(worker=0), AllBlocksCleared(worker=1))
    assert eng.statistics().cached_blocks == 0


def test_reset_prefix_cache_refuses_while_blocks_are_held() -> None:
    """reset_prefix_cache drops nothing while a running request holds a cached block."""
    eng = Engine(deployment())
    hashes = chain("reset", 5)
    eng.submit(spec(80, 50, block_hashes=hashes))
    eng.step()
    eng.step()
    eng.step()
    assert eng.statistics().cached_blocks == 5
    assert not eng.reset_prefix_cache()
    run(eng)
    assert eng.reset_prefix_cache()
    assert eng.statistics().cached_blocks == 0
    assert eng.take_kv_events() == ()  # not recorded unless asked for
