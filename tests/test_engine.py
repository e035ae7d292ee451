"""The engine core: request accounting, KV blocks, scheduler, policies, events."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_lab.core.engine import Engine
from inference_lab.errors import RequestRefused
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


# ------------------------------------------------------------------ accounting


def test_lone_request_computes_prompt_plus_target_minus_one_positions() -> None:
    """A request computes P + target - 1 positions: one prefill pass emitting token 1,
    then one decode step per further token."""
    eng = Engine(deployment())
    rid = eng.submit(spec(100, 10))
    events = run(eng)
    steps = [ev.step for ev in events if ev.step is not None]
    assert sum(s.num_tokens for s in steps) == 100 + 10 - 1
    assert [s.num_tokens for s in steps] == [100] + [1] * 9
    assert tokens_by_request(events) == {rid: 10}
    f = finished(events)[rid]
    assert (f.output_tokens, f.finish_reason, f.prompt_tokens) == (10, "length", 100)


def test_first_token_at_end_of_prefill_step_and_e2e_is_sum_of_steps() -> None:
    """Token 1 is stamped with the END of the step that finishes prefill; the finish time is
    the end of the last decode step."""
    eng = Engine(deployment())
    rid = eng.submit(spec(100, 4, arrival_time=2.0))
    events = run(eng)
    f = finished(events)[rid]
    prefill = _cost(eng, [100], [0])
    decodes = [_cost(eng, [1], [100 + i]) for i in range(3)]
    assert f.arrival_time == 2.0
    assert f.first_token_time == pytest.approx(2.0 + prefill, abs=1e-12)
    assert f.finish_time == pytest.approx(2.0 + prefill + sum(decodes), abs=1e-12)
    first = next(ev for ev in events if ev.tokens)
    assert first.time == pytest.approx(2.0 + prefill, abs=1e-12)


def test_target_below_max_tokens_stops_early_with_stop() -> None:
    """A hidden target stops the request early and finish_reason is 'stop'."""
    eng = Engine(deployment())
    rid = eng.submit(spec(10, 50, target=7))
    f = finished(run(eng))[rid]
    assert (f.output_tokens, f.finish_reason) == (7, "stop")


def test_single_token_request_finishes_at_prefill_end() -> None:
    """target 1: the prefill emits the only token and the request finishes in that step."""
    eng = Engine(deployment())
    rid = eng.submit(spec(30, 1))
    events = run(eng)
    f = finished(events)[rid]
    assert f.first_token_time == f.finish_time
    assert sum(1 for ev in events if ev.step) == 1


def test_chunked_prefill_splits_by_threshold_and_emits_after_last_chunk() -> None:
    """long_prefill_token_threshold caps each prefill chunk; no token before the last."""
    eng = Engine(deployment(long_prefill_token_threshold=32))
    rid = eng.submit(spec(100, 2))
    events = run(eng)
    steps = [ev.step.num_tokens for ev in events if ev.step]
    assert steps == [32, 32, 32, 4, 1]
    f = finished(events)[rid]
    ends = [ev.time for ev in events if ev.tokens]
    assert f.first_token_time == ends[0]
    costs = _cost(eng, [32], [0]) + _cost(eng, [32], [32]) + _cost(eng, [32], [64])
    costs += _cost(eng, [4], [96])
    assert f.first_token_time == pytest.approx(costs, abs=1e-12)


def test_step_budget_chunks_prefill_across_requests() -> None:
    """max_num_batched_tokens bounds a step; running requests go first, new ones fill the
    rest of the budget with a partial chunk."""
    eng = Engine(deployment(max_num_batched_tokens=150))
    eng.submit(spec(100, 3))
    eng.submit(spec(100, 3))
    events = run(eng)
    steps = [ev.step for ev in events if ev.step]
    assert steps[0].num_tokens == 150 and steps[0].num_seqs == 2
    assert steps[1].num_tokens == 1 + 50 and steps[1].num_seqs == 2


def test_disabled_chunked_prefill_waits_for_whole_prompt_budget() -> None:
    """With chunked prefill off, a prompt is never split: the second waits a step."""
    eng = Engine(deployment(max_num_batched_tokens=150, enable_chunked_prefill=False))
    eng.submit(spec(100, 3))
    eng.submit(spec(100, 3))
    steps = [ev.step for ev in run(eng) if ev.step]
    assert steps[0].num_tokens == 100 and steps[0].num_seqs == 1
    assert steps[1].num_tokens == 101 and steps[1].num_seqs == 2


def test_two_overlapping_requests_share_steps_priced_for_the_batch() -> None:
    """Requests running together are priced as one batch, not one by one."""
    eng = Engine(deployment())
    eng.submit(spec(20, 3))
    eng.submit(spec(20, 3))
    steps = [ev.step for ev in run(eng) if ev.step]
    assert steps[0].num_seqs == 2
    assert steps[0].duration == pytest.approx(_cost(eng, [20, 20], [0, 0]))
    assert steps[1].duration == pytest.approx(_cost(eng, [1, 1], [20, 20]))


# ------------------------------------------------------------------ refusal


def test_too_long_for_max_seq_len_refused_with_reason() -> None:
    """P + max_tokens > max_seq_len is refused by check_fits and submit, naming both."""
    eng = Engine(deployment())
    refused = eng.check_fits(131_000, 100)
    assert refused is not None and refused.limit == "max_seq_len"
    assert "131100" in refused.reason and "131072" in refused.reason
    with pytest.raises(RequestRefused):
        eng.submit(spec(131_000, 100))
    assert eng.next_event_time() is None


def test_too_large_for_kv_cache_refused_with_reason() -> None:
    """A request whose blocks_for(P + max_tokens) exceeds the replica's blocks is refused."""
    eng = Engine(deployment(blocks=10))
    assert eng.check_fits(100, 60) is None  # 160 tokens = 10 blocks of 16
    refused = eng.check_fits(100, 61)
    assert refused is not None and refused.limit == "kv_cache"
    assert "11 KV blocks" in refused.reason and "10" in refused.reason


# ------------------------------------------------------------------ preemption


def test_preemption_recomputes_and_keeps_output() -> None:
    """When KV runs out, fcfs preempts the most recently admitted request; it re-prefills
    P + output - 1 positions emitting nothing, then decodes on to its full length."""
    eng = Engine(deployment(blocks=10))
    a = eng.submit(spec(64, 48))  # 4 blocks now, 7 at the end
    b = eng.submit(spec(64, 48))
    events = run(eng)
    fin = finished(events)
    assert fin[a].output_tokens == 48 and fin[b].output_tokens == 48
    assert fin[a].preemptions == 0 and fin[b].preemptions >= 1
    assert tokens_by_request(events) == {a: 48, b: 48}
    assert eng.statistics().preemptions == fin[b].preemptions
    total = sum(ev.step.num_tokens for ev in events if ev.step)
    assert total > 2 * (64 + 48 - 1)  # recompute happened
    assert_blocks_conserved(eng)
    assert eng.workers[0].free_blocks == 10


@pytest.mark.parametrize("threshold", [0, 16])
def test_a_preempted_request_finds_its_blocks_again(threshold: int) -> None:
    """A preempted request gives back every block; re-admitted (its re-prefill in one
    step, or chunked 16 positions at a time) it takes them again step by step as its
    positions grow: every member of every step holds exactly the blocks its positions
    need, and the cache ends empty."""
    eng = Engine(deployment(blocks=10, long_prefill_token_threshold=threshold))
    a = eng.submit(spec(64, 48))
    b = eng.submit(spec(64, 48))
    events = []
    while eng.next_event_time() is not None:
        events.append(eng.step())
        assert_blocks_conserved(eng)
    fin = finished(events)
    assert fin[b].preemptions >= 1 and fin[a].output_tokens == fin[b].output_tokens == 48
    assert eng.workers[0].free_blocks == 10


def test_preempted_request_emits_nothing_during_reprefill() -> None:
    """Token counts never go backwards or repeat across a preemption."""
    eng = Engine(deployment(blocks=10))
    eng.submit(spec(64, 48))
    b = eng.submit(spec(64, 48))
    seen = 0
    for ev in run(eng):
        for rid, n in ev.tokens:
            if rid == b:
                assert n == 1
                seen += n
    assert seen == 48


@pytest.mark.parametrize(
    ("policy", "expected_order"),
    [
        ("fcfs", [1, 2, 3, 4]),
        ("priority", [3, 1, 4, 2]),
        ("sjf", [2, 4, 1, 3]),
        ("ljf", [3, 1, 4, 2]),
    ],
)
def test_policy_admission_order(policy: str, expected_order: list[int]) -> None:
    """Each policy admits in its order: fcfs arrival, priority lowest value, sjf smallest
    max_tokens, ljf largest."""
    eng = Engine(deployment(policy=policy, max_num_seqs=1))
    blocker = eng.submit(spec(10, 2))
    # (priority, max_tokens) per request 1..4, all arriving while the blocker runs
    shape = {1: (5, 30), 2: (9, 10), 3: (1, 40), 4: (7, 20)}
    ids = {}
    for k, (prio, mt) in shape.items():
        ids[eng.submit(spec(10, mt, priority=prio, arrival_time=1e-6 * k))] = k
    fin = finished(run(eng))
    order = sorted((f.first_scheduled_time, ids[rid]) for rid, f in fin.items() if rid != blocker)
    assert [k for _, k in order] == expected_order


@pytest.mark.parametrize(
    ("policy", "victim"),
    [("fcfs", 3), ("priority", 1), ("sjf", 2), ("ljf", 2)],
)
def test_policy_victim_choice(policy: str, victim: int) -> None:
    """When a running request needs a block and none is free, the victim is: fcfs the most
    recently admitted, priority the highest value, sjf/ljf the most remaining tokens."""
    # three 16-token prompts fill the 3 blocks; the first decode needs a 2nd block each.
    eng = Engine(deployment(policy=policy, blocks=3))
    shape = {1: (9, 10), 2: (5, 30), 3: (1, 20)}  # priority, max_tokens
    ids = {}
    for k, (prio, mt) in shape.items():
        ids[eng.submit(spec(16, mt, priority=prio))] = k
    while True:
        ev = eng.step()
        if ev.step is not None and ev.step.preempted:
            break
    # preempted requests are pushed to the FRONT of waiting: the first victim is last there
    first_victim = eng.workers[0].waiting.front[-1]
    assert ids[first_victim.id] == victim
    assert first_victim.preemptions == 1 and first_victim.num_computed == 0
    fin = finished(run(eng))
    assert {ids[rid]: f.output_tokens for rid, f in fin.items()} == {1: 10, 2: 30, 3: 20}
    assert_blocks_conserved(eng)


# ------------------------------------------------------------------ abort


def test_abort_pending_arrival_returns_everything() -> None:
    """An arrival aborted before any step never enters a worker and emits nothing."""
    eng = Engine(deployment())
    rid = eng.submit(spec(10, 5))
    assert eng.abort(rid)
    assert eng.next_event_time() is None and eng.is_idle()
    assert eng.statistics().pending_arrivals == 0
    assert not eng.abort(rid)  # idempotent


def test_abort_waiting_request() -> None:
    """A waiting request aborted leaves the queue; the rest of the run is unaffected."""
    eng = Engine(deployment(max_num_seqs=1))
    a = eng.submit(spec(10, 5))
    b = eng.submit(spec(10, 5))
    eng.step()
    eng.step()  # both arrived; boundary not yet handled
    assert eng.num_waiting() == 2
    eng.step()  # a admitted
    assert eng.num_waiting() == 1 and eng.num_running() == 1
    assert eng.abort(b)
    assert eng.num_waiting() == 0
    events = run(eng)
    assert b not in tokens_by_request(events)
    assert a in finished(events)
    assert eng.workers[0].free_blocks == eng.workers[0].total_blocks


@pytest.mark.parametrize("phase", ["mid_prefill", "decoding"])
def test_abort_running_returns_every_block(phase: str) -> None:
    """A running request aborted mid-prefill or while decoding frees all its blocks at
    once, emits nothing more, and the engine goes idle."""
    eng = Engine(deployment(long_prefill_token_threshold=16))
    rid = eng.submit(spec(64, 20))
    if phase == "mid_prefill":
        run(eng, until=_cost(eng, [16], [0]) * 1.5)
        assert eng.workers[0].running and eng.workers[0].running[0].num_computed < 64
    else:
        run(eng, until=0.01)
        assert eng.workers[0].running[0].num_output >= 1
    assert eng.workers[0].free_blocks < eng.workers[0].total_blocks
    assert eng.abort(rid)
    assert eng.workers[0].free_blocks == eng.workers[0].total_blocks
    events = run(eng)
    assert tokens_by_request(events) == {}
    assert eng.is_idle() and eng.num_running() == 0


# ------------------------------------------------------------------ conservation


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 300),  # prompt
            st.integers(1, 80),  # max_tokens
            st.floats(0, 0.5),  # arrival
            st.booleans(),  # abort at some point
        ),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from(["fcfs", "priority", "sjf", "ljf"]),
    st.integers(1, 3),
    st.integers(0, 2**31),
)
def test_kv_blocks_conserved_over_random_runs(
    reqs: list[tuple[int, int, float, bool]], policy: str, replicas: int, seed: int
) -> None:
    """Free + held blocks equal the total at every step, across admissions, preemptions,
    completions and aborts; at the end every block is free and every request either
    finished with its full length or was aborted."""
    rng = np.random.default_rng(seed)
    eng = Engine(
        deployment(
            policy=policy,
            blocks=40,
            replicas=replicas,
            max_num_batched_tokens=256,
            long_prefill_token_threshold=int(rng.integers(0, 100)),
            router="least_loaded" if seed % 2 else "round_robin",
        )
    )
    ids = []
    for prompt, mt, arrival, _ in reqs:
        ids.append(eng.submit(spec(prompt, mt, arrival_time=arrival, priority=prompt % 3)))
    aborts = {rid for rid, r in zip(ids, reqs, strict=True) if r[3]}
    emitted: dict[int, int] = {}
    fin = {}
    while eng.next_event_time() is not None:
        ev = eng.step()
        for rid, n in ev.tokens:
            emitted[rid] = emitted.get(rid, 0) + n
        for f in ev.finished:
            fin[f.request_id] = f
        assert_blocks_conserved(eng)
        if aborts and rng.random() < 0.2:
            eng.abort(aborts.pop())
            assert_blocks_conserved(eng)
    for w in eng.workers:
        assert w.free_blocks == w.total_blocks
    for rid, (_prompt, mt, _, _) in zip(ids, reqs, strict=True):
        if rid in fin:
            assert fin[rid].output_tokens == mt == emitted[rid]
        else:
            assert emitted.get(rid, 0) < mt
    assert eng.is_idle()


# ------------------------------------------------------------------ max_num_seqs


def test_lowering_max_num_seqs_drains_without_evicting() -> None:
    """Lowering the cap mid-run cancels and preempts nothing: the running count falls step
    by step to the new cap and every request completes."""
    eng = Engine(deployment())
    ids = [eng.submit(spec(20, 30 + 5 * i)) for i in range(8)]
    run(eng, until=0.02)
    assert eng.num_running() == 8
    eng.set_max_num_seqs(2)
    counts = []
    events = []
    while eng.next_event_time() is not None:
        ev = eng.step()
        events.append(ev)
        counts.append(eng.num_running())
    assert all(b <= a for a, b in zip(counts, counts[1:], strict=False))
    fin = finished(events)
    assert set(fin) == set(ids)
    assert all(f.preemptions == 0 for f in fin.values())
    assert eng.statistics().preemptions == 0 and eng.statistics().aborted == 0


def test_lowered_cap_is_respected_by_later_admissions() -> None:
    """After lowering, waiting requests are admitted only while running < new cap."""
    eng = Engine(deployment(max_num_seqs=4))
    for _ in range(10):
        eng.submit(spec(20, 20))
    run(eng, until=0.005)
    eng.set_max_num_seqs(2)
    peak_after_drain = 0
    drained = False
    while eng.next_event_time() is not None:
        eng.step()
        if eng.num_running() <= 2:
            drained = True
        if drained:
            peak_after_drain = max(peak_after_drain, eng.num_running())
    assert peak_after_drain == 2


def test_raising_max_num_seqs_admits_waiting_at_next_step() -> None:
    """A raised cap admits waiting requests at the next boundary."""
    eng = Engine(deployment(max_num_seqs=1))
    for _ in range(3):
        eng.submit(spec(20, 50))
    run(eng, until=0.005)
    assert (eng.num_running(), eng.num_waiting()) == (1, 2)
    eng.set_max_num_seqs(3)
    ev = eng.step()
    assert ev.step is not None and ev.step.num_seqs == 3
    with pytest.raises(ValueError):
        eng.set_max_num_seqs(0)


# ------------------------------------------------------------------ replicas, time


def test_round_robin_alternates_workers() -> None:
    """round_robin sends arrivals to workers in turn."""
    eng = Engine(deployment(replicas=3))
    for _ in range(6):
        eng.submit(spec(10, 5))
    for _ in range(6):
        eng.step()
    assert [w.waiting.count for w in eng.workers] == [2, 2, 2]


def test_least_loaded_prefers_fewest_running_plus_waiting() -> None:
    """least_loaded picks the worker with fewest running+waiting, then the lowest index."""
    eng = Engine(deployment(replicas=2, router="least_loaded"))
    eng.submit(spec(10, 100))
    eng.submit(spec(10, 100))
    run(eng, until=0.01)
    eng.submit(spec(10, 5))
    eng.step()
    loads = [len(w.running) + w.waiting.count for w in eng.workers]
    assert loads == [2, 1]


def test_advance_to_moves_idle_clock_and_submit_uses_now() -> None:
    """advance_to skips idle time; an arrival stamped in the past is queued at now."""
    eng = Engine(deployment())
    assert eng.is_idle() and eng.next_event_time() is None
    eng.advance_to(3600.0)
    assert eng.now == 3600.0
    rid = eng.submit(spec(50, 2, arrival_time=0.0))
    assert eng.next_event_time() == 3600.0
    f = finished(run(eng))[rid]
    assert f.arrival_time == 3600.0
    assert f.first_token_time - f.arrival_time == pytest.approx(_cost(eng, [50], [0]))


def test_advance_to_refuses_to_skip_an_event() -> None:
    """The clock never jumps over a pending event."""
    eng = Engine(deployment())
    eng.submit(spec(10, 2, arrival_time=1.0))
    with pytest.raises(ValueError):
        eng.advance_to(2.0)


def test_same_inputs_same_result() -> None:
    """The engine is deterministic: identical submissions give identical events."""

    def once() -> list[tuple[float, tuple[tuple[int, int], ...]]]:
        eng = Engine(deployment(GPT_OSS_20B, blocks=200))
        rng = np.random.default_rng(7)
        t = 0.0
        for _ in range(60):
            t += float(rng.exponential(0.01))
            eng.submit(spec(int(rng.integers(1, 500)), int(rng.integers(1, 200)), arrival_time=t))
        return [(ev.time, ev.tokens) for ev in run(eng)]

    assert once() == once()


def test_statistics_snapshot_counts() -> None:
    """statistics() reports waiting, running, KV use, steps and finished."""
    eng = Engine(deployment(max_num_seqs=1))
    eng.submit(spec(32, 3))
    eng.submit(spec(32, 3))
    run(eng, until=0.0)
    s = eng.statistics()
    assert (s.running, s.waiting, s.pending_arrivals) == (1, 1, 0)
    assert s.kv_used_blocks == math.ceil(32 / 16)
    run(eng)
    s = eng.statistics()
    assert (s.running, s.waiting, s.finished, s.kv_used_blocks) == (0, 0, 2, 0)
    assert s.steps == 6


def test_wide_event_records_are_keyword_only() -> None:
    """Finished, StepInfo and StepEvents are built by keyword: a positional call (which
    silently swaps same-typed fields) is a TypeError."""
    from inference_lab.core.engine import Finished, StepEvents, StepInfo

    with pytest.raises(TypeError):
        Finished(1, 10, 5, "length", 0.0, 0.0, 0.1, 0.2, 0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        StepInfo(0, 0.0, 0.1, 1, 1, 0.5, 0.1, 0.2, 0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        StepEvents(0.0, (), (), (), None)  # type: ignore[misc]
