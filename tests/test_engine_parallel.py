"""Parallel sampling in the engine: a request of n sequences shares its prompt's KV blocks,
prefills once, decodes n sequences as batch members and is scheduled as one unit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_lab.core.engine import Engine
from tests.engine_util import (
    GPT_OSS_20B,
    assert_blocks_conserved,
    deployment,
    finished,
    run,
    spec,
    tokens_by_request,
)


def _cost(engine: Engine, n: list[int], c: list[int]) -> float:
    return engine.roofline.step_time(np.array(n, dtype=np.int64), np.array(c, dtype=np.int64))


def test_group_prefills_the_prompt_once_then_decodes_every_sequence() -> None:
    """n = 4: one prefill pass of P positions (one sequence) emits token 1 of every choice;
    each later step computes 4 positions (4 sequences), priced as 4 batch members."""
    eng = Engine(deployment())
    rid = eng.submit(spec(100, 5, n=4))
    events = run(eng)
    steps = [ev.step for ev in events if ev.step is not None]
    assert [s.num_tokens for s in steps] == [100, 4, 4, 4, 4]
    assert [s.num_seqs for s in steps] == [1, 4, 4, 4, 4]
    assert steps[0].duration == pytest.approx(_cost(eng, [100], [0]))
    assert steps[1].duration == pytest.approx(_cost(eng, [1] * 4, [100] * 4))
    # tokens are reported per choice: all choices advance together
    assert [ev.tokens for ev in events if ev.tokens] == [((rid, 1),)] * 5
    f = finished(events)[rid]
    assert (f.output_tokens, f.n, f.finish_reason, f.prompt_tokens) == (5, 4, "length", 100)


def test_group_hidden_target_stops_every_sequence_with_stop() -> None:
    """A target below max_tokens ends all n sequences there, finish_reason 'stop'."""
    eng = Engine(deployment())
    rid = eng.submit(spec(20, 50, target=3, n=2))
    f = finished(run(eng))[rid]
    assert (f.output_tokens, f.finish_reason, f.n) == (3, "stop", 2)


@pytest.mark.parametrize(("prompt", "after_prefill", "after_decode"), [(64, 4, 7), (70, 5, 7)])
def test_group_shares_full_prompt_blocks_and_copies_the_partial_one(
    prompt: int, after_prefill: int, after_decode: int
) -> None:
    """n = 3, 16-token blocks: the prefill holds blocks_for(P) once; after the first decode
    the P // 16 full prompt blocks are shared and each sequence holds the rest itself
    (its copy of a partly filled prompt block and its output block)."""
    eng = Engine(deployment(blocks=100))
    eng.submit(spec(prompt, 10, n=3))
    used = []
    while eng.next_event_time() is not None:
        ev = eng.step()
        if ev.step is not None:
            used.append(eng.statistics().kv_used_blocks)
        assert_blocks_conserved(eng)
    assert used[0] == after_prefill
    assert used[1] == after_decode
    assert eng.statistics().kv_used_blocks == 0


def test_group_sequences_count_toward_max_num_seqs() -> None:
    """max_num_seqs caps running sequences: with a group of 3 running under a cap of 4,
    one plain request joins and the next waits until the group finishes."""
    eng = Engine(deployment(max_num_seqs=4))
    group = eng.submit(spec(20, 10, n=3))
    a = eng.submit(spec(20, 10, arrival_time=1e-6))
    b = eng.submit(spec(20, 10, arrival_time=2e-6))
    peak = 0
    events = []
    while eng.next_event_time() is not None:
        events.append(eng.step())
        stats = eng.statistics()
        peak = max(peak, stats.running_seqs)
        assert stats.running_seqs <= 4
    fin = finished(events)
    assert peak == 4
    assert fin[a].first_scheduled_time < fin[group].finish_time
    assert fin[b].first_scheduled_time >= min(fin[group].finish_time, fin[a].finish_time)


def test_group_wider_than_the_cap_runs_alone() -> None:
    """A group of n > max_num_seqs is admitted when its worker runs nothing, rather than
    waiting forever; nothing else is admitted beside it."""
    eng = Engine(deployment(max_num_seqs=2))
    group = eng.submit(spec(20, 5, n=4))
    plain = eng.submit(spec(20, 5, arrival_time=1e-6))
    fin = finished(run(eng))
    assert fin[group].output_tokens == 5
    assert fin[plain].first_scheduled_time >= fin[group].finish_time


def test_abort_group_returns_every_block() -> None:
    """Aborting a decoding group frees the shared and the per-sequence blocks at once and
    it emits nothing more."""
    eng = Engine(deployment(blocks=50))
    rid = eng.submit(spec(40, 30, n=3))
    run(eng, until=_cost(eng, [40], [0]) * 3)
    stats = eng.statistics()
    assert stats.running_seqs == 3 and stats.kv_used_blocks > 3
    assert eng.abort(rid)
    stats = eng.statistics()
    assert (stats.kv_used_blocks, stats.running, stats.running_seqs) == (0, 0, 0)
    assert tokens_by_request(run(eng)) == {}
    assert eng.is_idle()


def test_preempted_group_reprefills_the_prompt_once_then_its_outputs() -> None:
    """A group preempted with output k re-prefills P positions once, then k - 1 positions
    for each of its n sequences, emitting nothing, and still ends with max_tokens tokens
    per choice."""
    eng = Engine(deployment(blocks=12))
    a = eng.submit(spec(64, 40))  # 4 blocks, growing to 7
    g = eng.submit(spec(64, 20, n=2))  # 4 blocks, growing to 4 + 2 * 2
    events = run(eng)
    fin = finished(events)
    assert fin[a].output_tokens == 40 and fin[g].output_tokens == 20
    assert fin[g].preemptions >= 1
    assert tokens_by_request(events) == {a: 40, g: 20}
    # every decode step of the group schedules both sequences together
    assert all(n == 1 for ev in events for rid, n in ev.tokens if rid == g)
    assert eng.statistics().kv_used_blocks == 0


def test_check_fits_counts_every_sequence_of_a_group() -> None:
    """The fit check refuses a group whose n sequences can never hold their blocks, or
    that cannot decode in one step's token budget, and names the limit."""
    eng = Engine(deployment(blocks=10))
    assert eng.check_fits(64, 16, n=1) is None  # 80 positions = 5 blocks
    # 4 shared prompt blocks + 3 * (5 - 4) blocks
    assert eng.check_fits(64, 16, n=3) is None
    refused = eng.check_fits(64, 16, n=7)  # 4 + 7 = 11 blocks
    assert refused is not None and refused.limit == "kv_cache"
    assert "n = 7" in refused.reason and "11 KV blocks" in refused.reason
    small = Engine(deployment(max_num_batched_tokens=4))
    refused = small.check_fits(2, 2, n=5)
    assert refused is not None and refused.limit == "batch_tokens"
    unchunked = Engine(deployment(max_num_batched_tokens=100, enable_chunked_prefill=False))
    assert unchunked.check_fits(90, 11, n=1) is None  # a re-prefill of 100 positions
    assert unchunked.check_fits(90, 12, n=1) is not None
    assert unchunked.check_fits(50, 26, n=4) is None  # 4 * 25 re-prefilled outputs
    refused = unchunked.check_fits(50, 30, n=4)  # re-prefilled outputs: 4 * 29 > 100
    assert refused is not None and refused.limit == "batch_tokens"


def test_submit_refuses_n_below_one() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        Engine(deployment()).submit(spec(10, 5, n=0))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 200),  # prompt
            st.integers(1, 60),  # max_tokens
            st.integers(1, 4),  # n
            st.floats(0, 0.3),  # arrival
            st.booleans(),  # abort at some point
        ),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from(["fcfs", "priority", "sjf", "ljf"]),
    st.booleans(),
    st.integers(0, 2**31),
)
def test_kv_blocks_conserved_with_groups(
    reqs: list[tuple[int, int, int, float, bool]], policy: str, windowed: bool, seed: int
) -> None:
    """Free + held blocks equal the total after every step and abort, with groups and
    plain requests mixed, under preemption; at the end every block is free, every group
    finished with max_tokens per choice (reported once per step per group) or was
    aborted. ``windowed`` uses gpt-oss-20b, whose private (windowed) blocks each sequence
    holds itself."""
    rng = np.random.default_rng(seed)
    dep = (
        deployment(GPT_OSS_20B, blocks=60, policy=policy, max_num_batched_tokens=256)
        if windowed
        else deployment(
            policy=policy,
            blocks=40,
            max_num_batched_tokens=256,
            max_num_seqs=6,
            long_prefill_token_threshold=int(rng.integers(0, 100)),
        )
    )
    eng = Engine(dep)
    ids = []
    for prompt, mt, n, arrival, _ in reqs:
        if eng.check_fits(prompt, mt, n) is None:
            ids.append(eng.submit(spec(prompt, mt, n=n, arrival_time=arrival)))
        else:
            ids.append(-1)
    aborts = {rid for rid, r in zip(ids, reqs, strict=True) if r[4] and rid > 0}
    emitted: dict[int, int] = {}
    fin = {}
    while eng.next_event_time() is not None:
        ev = eng.step()
        for rid, count in ev.tokens:
            emitted[rid] = emitted.get(rid, 0) + count
        for f in ev.finished:
            fin[f.request_id] = f
        assert_blocks_conserved(eng)
        stats = eng.statistics()
        assert stats.running_seqs >= stats.running
        if aborts and rng.random() < 0.2:
            eng.abort(aborts.pop())
            assert_blocks_conserved(eng)
    assert eng.statistics().kv_used_blocks == 0
    for rid, (_prompt, mt, n, _, _) in zip(ids, reqs, strict=True):
        if rid in fin:
            assert fin[rid].output_tokens == mt == emitted[rid] and fin[rid].n == n
        elif rid > 0:
            assert emitted.get(rid, 0) < mt
    assert eng.is_idle()
