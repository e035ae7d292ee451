"""Speculative decoding and data-parallel attention in the engine (drafting Rule 1, dp_group Rule 1).

A verify step computes ``1 + gamma`` positions per decoding sequence and reserves their
KV blocks and token budget; its end advances the sequence by ``1 + accepted`` (capped by
its remaining length); a preemption or an abort frees everything; the prefix cache caches
what is computed. Draws come from the engine's own seeded generator. Data-parallel ranks
step in lockstep, priced as one step.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from inference_lab.core.admission import Admission
from inference_lab.core.config import Deployment, load_deployment, load_model_config
from inference_lab.core.engine import Engine, RequestSpec, StepEvents
from inference_lab.core.speculative import FixedAcceptance, RateAcceptance, expected_length
from tests.configs_util import moe_config, write_setup
from tests.engine_util import run, tokens_by_request

ROOT = Path(__file__).resolve().parent.parent
EAGLE = ROOT / "configs" / "frontier" / "Llama-3.1-8B-Instruct-EAGLE.toml"
DEEPSEEK = ROOT / "configs" / "frontier" / "DeepSeek-V3.toml"


def eagle(**scheduler: Any) -> Deployment:
    """Llama-3.1-8B with its EAGLE drafter on H200: gamma 3, blocks of 16 tokens."""
    dep = load_deployment(EAGLE, "h200")
    if scheduler:
        dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, **scheduler))
    return dep


def with_blocks(dep: Deployment, blocks: int) -> Deployment:
    sched = attrs.evolve(dep.scheduler, kv_cache_capacity=blocks * dep.block_bytes)
    return attrs.evolve(dep, scheduler=sched)


def steps_of(engine: Engine) -> list[tuple[StepEvents, int]]:
    """Every event to the end, with the KV blocks in use once it was handled."""
    out = []
    while engine.next_event_time() is not None:
        events = engine.step()
        out.append((events, engine.statistics().kv_used_blocks))
    return out


def test_verify_steps_advance_by_one_plus_accepted_and_reserve_their_width() -> None:
    """P = 30, max_tokens 20, gamma 3, accepted 3, 0, 2, 1, 3, 0, 2. The prefill holds
    ceil(30/16) = 2 blocks and emits token 1; then each verify computes 4 positions from c
    and reserves ceil((c + 4)/16) blocks: c = 30, 34, 35, 38, 40, 44 -> 3 blocks; c = 45
    -> 4 (49 positions). Their ends emit 4, 1, 3, 2, 4, 1, 3 tokens. At 19 tokens only 0
    drafts fit under max_tokens: a plain step of 1 position (no draw), token 20."""
    engine = Engine(eagle(), acceptance=FixedAcceptance([3, 0, 2, 1, 3, 0, 2, 3]))
    rid = engine.submit(RequestSpec(prompt_tokens=30, max_tokens=20))
    steps = [(ev, used) for ev, used in steps_of(engine) if ev.step or ev.tokens]
    started = [(ev.step.num_tokens, used) for ev, used in steps if ev.step is not None]
    assert started == [(30, 2), (4, 3), (4, 3), (4, 3), (4, 3), (4, 3), (4, 3), (4, 4), (1, 4)]
    emitted = [dict(ev.tokens)[rid] for ev, _ in steps if ev.tokens]
    assert emitted == [1, 4, 1, 3, 2, 4, 1, 3, 1]
    assert steps[-1][0].finished[0].output_tokens == 20
    assert steps[-1][1] == 0  # everything freed at the end
    drafts = [ev.step.accepted_tokens for ev, _ in steps if ev.step is not None and ev.step.drafts]
    assert drafts == [3, 0, 2, 1, 3, 0, 2]


def test_a_verify_never_emits_past_the_requests_hidden_length() -> None:
    """The scheduler drafts 3 (max_tokens 20 leaves room) but the request stops at 7: after
    1 + 4 + 1 tokens an accepted 2 emits only the 1 token left."""
    engine = Engine(eagle(), acceptance=FixedAcceptance([3, 0, 2]))
    rid = engine.submit(RequestSpec(prompt_tokens=30, max_tokens=20, target=7))
    events = run(engine)
    emitted = [dict(ev.tokens)[rid] for ev in events if ev.tokens]
    assert emitted == [1, 4, 1, 1]
    (done,) = [f for ev in events for f in ev.finished]
    assert (done.output_tokens, done.finish_reason) == (7, "stop")


def test_a_verify_step_reserves_its_token_budget() -> None:
    """With a budget of 6 tokens, two decoding requests verify 4 positions each only while
    the budget lasts: the first takes 4, the second the 2 left (1 draft token)."""
    dep = eagle(max_num_batched_tokens=64)
    engine = Engine(dep, acceptance=FixedAcceptance([0]))
    for _ in range(2):
        engine.submit(RequestSpec(prompt_tokens=30, max_tokens=50))
    run(engine, until=0.0)  # both admitted: one prefill step of 60 positions
    dep_small = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, max_num_batched_tokens=6))
    for w in engine.workers:
        w.budget = dep_small.scheduler.max_num_batched_tokens
    ev = engine.step()  # the prefill ends, the first verify step starts
    assert ev.step is not None and ev.step.num_tokens == 6 and ev.step.num_seqs == 2
    assert ev.step.draft_tokens == 3 + 1


def test_every_step_frees_exactly_what_a_preemption_or_abort_takes_back() -> None:
    """A cache of 6 blocks and three requests that outgrow it with their lookahead: the
    scheduler preempts, and after every event the free blocks plus those the running
    requests hold equal the total; each member of the step in flight holds at least its
    width's blocks; aborting everything mid-run gives every block back."""
    dep = with_blocks(eagle(), 6)
    engine = Engine(dep)
    ids = [engine.submit(RequestSpec(prompt_tokens=20, max_tokens=40)) for _ in range(3)]
    preempted = 0
    for _ in range(40):
        if engine.next_event_time() is None:
            break
        ev = engine.step()
        if ev.step is not None:
            preempted += ev.step.preempted
        w = engine.workers[0]
        held = sum(r.num_blocks for r in w.running)
        assert w.free_blocks + held == w.total_blocks
        for r, _advance in w.batch:
            if r in w.running:
                assert r.num_blocks >= w.kv.blocks_for(r.num_computed + 1)
    assert preempted > 0
    for rid in ids:
        engine.abort(rid)
    assert engine.statistics().kv_used_blocks == 0


def test_prefix_caching_caches_the_accepted_positions() -> None:
    """A request carrying hashes caches a block once its accepted positions fill it: after
    the run, its 2 prompt blocks and the output blocks its computed positions filled are
    cached (P = 32, 20 tokens: 51 positions computed, 3 full blocks), none of the
    rejected lookahead's."""
    engine = Engine(eagle(), acceptance=FixedAcceptance([3, 0, 2]))
    hashes = tuple(range(1, 6))  # 5 blocks: 80 tokens of prompt and answer
    engine.submit(RequestSpec(prompt_tokens=32, max_tokens=20, block_hashes=hashes))
    run(engine)
    pool = engine.workers[0].pool
    assert sorted(pool.ref) == [1, 2, 3]
    assert engine.statistics().kv_used_blocks == 0


def test_the_draws_come_from_the_engines_own_seeded_generator() -> None:
    """Two engines of one config draw the same run; another seed another run; the global
    ``random`` and numpy generators are neither used nor moved."""

    def run_once(seed: int) -> list[tuple[float, tuple[tuple[int, int], ...]]]:
        dep = eagle()
        assert dep.speculative is not None
        dep = attrs.evolve(dep, speculative=attrs.evolve(dep.speculative, seed=seed))
        engine = Engine(dep)
        for i in range(4):
            engine.submit(RequestSpec(prompt_tokens=50 + i, max_tokens=60))
        return [(ev.time, ev.tokens) for ev in run(engine) if ev.tokens]

    random.seed(7)
    np.random.seed(7)
    before = (random.random(), np.random.random())
    random.seed(7)
    np.random.seed(7)
    first, again, other = run_once(0), run_once(0), run_once(1)
    assert first == again
    assert first != other
    assert (random.random(), np.random.random()) == before


def test_rate_acceptance_accepts_position_j_at_its_rate() -> None:
    """Over 200,000 seeded draws of gamma 3 at alpha 0.7, the share accepting at least j
    positions is 0.7^j within 0.5 %, and the mean accepted count 0.7 + 0.49 + 0.343; a
    draw never exceeds the gamma asked for."""
    draws = RateAcceptance((0.7, 0.49, 0.343), seed=3)
    counts = [draws.draw(3) for _ in range(200_000)]
    for j, rate in enumerate((0.7, 0.49, 0.343), start=1):
        assert sum(1 for c in counts if c >= j) / len(counts) == pytest.approx(rate, abs=0.005)
    assert sum(counts) / len(counts) == pytest.approx(1.533, abs=0.01)
    assert max(draws.draw(1) for _ in range(1000)) == 1
    assert expected_length((0.7, 0.49, 0.343), 3) == pytest.approx(2.533)


def test_gamma_by_batch_lowers_the_draft_length_as_the_batch_grows() -> None:
    """``gamma_by_batch = [[2, 1], [3, 0]]``: one running sequence verifies 3 drafts, two
    verify 1 each, three none (plain steps of one position)."""
    base = eagle()
    assert base.speculative is not None
    spec = attrs.evolve(base.speculative, gamma_by_batch=((2, 1), (3, 0)))
    dep = attrs.evolve(base, speculative=spec)
    widths = []
    for count in (1, 2, 3):
        engine = Engine(dep, acceptance=FixedAcceptance([0]))
        for _ in range(count):
            engine.submit(RequestSpec(prompt_tokens=10, max_tokens=30))
        ev = run(engine, until=0.0)[-1]
        ev = engine.step()  # the prefill ends; the first decode step starts
        assert ev.step is not None
        widths.append(ev.step.num_tokens // count)
    assert widths == [4, 2, 1]


def test_time_to_next_finish_counts_decode_steps_by_mean_acceptance_length() -> None:
    """A request with 100 tokens left at gamma 3, alpha 0.7 needs ceil(100 / 2.533) = 40
    more steps, not 100."""
    engine = Engine(eagle(), acceptance=FixedAcceptance([0]))
    engine.submit(RequestSpec(prompt_tokens=30, max_tokens=101))
    run(engine, until=0.0)
    ev = engine.step()  # the prefill ends (token 1); a verify step starts
    assert ev.step is not None
    step = ev.step.duration
    eta = engine.time_to_next_finish(ev.time)
    assert eta == pytest.approx(step + (math.ceil(100 / 2.533) - 1) * step)


def test_the_admission_ledger_counts_the_running_verify_lookahead() -> None:
    """8 blocks; a request at P = 44 (3 blocks) verifies 4 positions (48: still 3 blocks)
    and accepts 3, so its next verify reaches 48 + 4 = 52 positions: a 4th block. A queued
    request whose first chunk takes 5 blocks fits the 5 free now but not the 4 left after
    that lookahead: the ledger gives it a waiting place, not a seat, and indeed the engine
    does not admit it at the next step."""
    dep = with_blocks(eagle(max_num_batched_tokens=512), 8)
    engine = Engine(dep, acceptance=FixedAcceptance([3]))
    engine.submit(RequestSpec(prompt_tokens=44, max_tokens=60))
    run(engine, until=0.0)
    ev = engine.step()  # the prefill ends; a verify of 44..47 starts, 3 blocks held
    assert ev.step is not None and ev.step.num_tokens == 4
    w = engine.workers[0]
    assert (w.free_blocks, w.verify_reserve()) == (5, 1)
    assert engine.queue_views()[0].free_blocks == 4
    spec = RequestSpec(prompt_tokens=70, max_tokens=10, arrival_time=engine.now)
    assert engine.first_chunk_blocks(spec, 0) == 5
    claim = Admission(engine, max_waiting=5).admit("b", spec)
    assert claim is not None and not claim.seated
    engine.submit(spec)
    engine.step()  # the arrival
    engine.step()  # the verify ends; the next one takes the 4th block; b waits
    stats = engine.statistics()
    assert (stats.running, stats.waiting, stats.kv_used_blocks) == (1, 1, 4)


def test_step_info_counts_drafts_and_the_plain_duration() -> None:
    """A verify step reports one draft of 3 tokens, its accepted count per position, and
    as ``plain_duration`` what its 3 tokens would take without speculation: the batch at
    width 1 (no drafter), then 2 more one-position steps at c + 1 (the accepted 2)."""
    engine = Engine(eagle(), acceptance=FixedAcceptance([2]))
    engine.submit(RequestSpec(prompt_tokens=30, max_tokens=20))
    run(engine, until=0.0)
    info = engine.step().step
    assert info is not None
    assert (info.drafts, info.draft_tokens, info.accepted_tokens) == (1, 3, 2)
    assert info.accepted_per_position == (1, 1)
    rf = engine.roofline
    plain = rf.price(rf.batch_terms([1], [30])).seconds
    later = rf.price(rf.batch_terms([1], [31])).seconds
    assert info.plain_duration == pytest.approx(plain + 2 * later, rel=1e-12)
    assert info.duration < info.plain_duration


def test_a_group_draws_once_for_its_sequences() -> None:
    """n = 3 choices decode together: each verify counts 3 drafts, and all three advance
    by the same 1 + accepted."""
    engine = Engine(eagle(), acceptance=FixedAcceptance([2, 1]))
    rid = engine.submit(RequestSpec(prompt_tokens=30, max_tokens=12, n=3))
    events = run(engine)
    infos = [ev.step for ev in events if ev.step is not None and ev.step.drafts]
    assert [(i.drafts, i.accepted_tokens) for i in infos][:2] == [(3, 6), (3, 3)]
    assert [dict(ev.tokens)[rid] for ev in events if ev.tokens][:3] == [1, 3, 2]
    assert tokens_by_request(events)[rid] == 12


# ---------------------------------------------------------------------------------------
# data-parallel attention ranks


def dp_deployment(tmp_path: Path) -> Deployment:
    config = moe_config(tp=4, ep=4, dp_attention=2)
    path, profiles = write_setup(tmp_path, config)
    return load_model_config(path, profiles).deployments["gpu"]


def test_dp_ranks_are_workers_that_step_in_lockstep(tmp_path: Path) -> None:
    """Two ranks: a 100-token prompt on rank 0 and a 1,000-token one on rank 1 start
    together; their first tokens come at the same time, one step priced for both (the
    slower rank's part plus the experts over 1,100 tokens), and every later token of both
    at the same step ends."""
    dep = dp_deployment(tmp_path)
    engine = Engine(dep)
    assert len(engine.workers) == 2
    a = engine.submit(RequestSpec(prompt_tokens=100, max_tokens=5, worker=0))
    b = engine.submit(RequestSpec(prompt_tokens=1000, max_tokens=5, worker=1))
    events = run(engine)
    firsts = [ev for ev in events if ev.step is not None]
    rf = engine.roofline
    expected = rf.group_price([rf.batch_terms([100], [0]), rf.batch_terms([1000], [0])])
    assert firsts[0].step is not None and firsts[0].step.duration == expected.seconds
    assert firsts[0].step.num_tokens == 1100
    times: dict[int, list[float]] = {a: [], b: []}
    for ev in events:
        for rid, _count in ev.tokens:
            times[rid].append(ev.time)
    assert times[a] == times[b] and len(times[a]) == 5
    assert engine.statistics().kv_used_blocks == 0


def test_an_idle_rank_waits_for_its_group(tmp_path: Path) -> None:
    """A request arriving at rank 1 while rank 0's step is in flight starts at that step's
    end (the next lockstep boundary), not at once; a request stamped before the step began
    joins it, which moves the group's step end."""
    dep = dp_deployment(tmp_path)
    engine = Engine(dep)
    engine.submit(RequestSpec(prompt_tokens=100, max_tokens=3, worker=0))
    ev = run(engine, until=0.0)[-1]
    assert ev.step is not None
    end = ev.step.duration
    late = engine.submit(RequestSpec(prompt_tokens=50, max_tokens=2, worker=1, arrival_time=1e-6))
    events = run(engine)
    first = next(e.time for e in events if dict(e.tokens).get(late))
    assert first > end
    # stamped before the step in flight began: it joins that step
    engine2 = Engine(dep)
    engine2.submit(RequestSpec(prompt_tokens=100, max_tokens=3, worker=0, arrival_time=0.001))
    run(engine2, until=0.001)  # the step starts at 1 ms
    joined = engine2.submit(
        RequestSpec(prompt_tokens=50, max_tokens=2, worker=1, arrival_time=0.0005)
    )
    events2 = run(engine2)
    t_first = next(e.time for e in events2 if dict(e.tokens).get(joined))
    rf = engine2.roofline
    both = rf.group_price([rf.batch_terms([100], [0]), rf.batch_terms([50], [0])])
    assert t_first == pytest.approx(0.001 + both.seconds, rel=1e-12)


def test_deepseek_v3_on_eight_h200_runs_eight_ranks_and_its_mtp_drafter() -> None:
    """The shipped DeepSeek-V3 on 8 x H200 (EP 8, DP attention 8): 8 workers, MLA layers,
    one MTP draft token per step; a small batch finishes with every block back."""
    dep = load_deployment(DEEPSEEK, "h200")
    assert dep.workers == 8 and dep.speculative is not None
    engine = Engine(dep)
    ids = [engine.submit(RequestSpec(prompt_tokens=500, max_tokens=40)) for _ in range(16)]
    events = run(engine)
    counts = tokens_by_request(events)
    assert all(counts[rid] == 40 for rid in ids)
    drafted = [ev.step for ev in events if ev.step is not None and ev.step.drafts]
    assert drafted and all(s.draft_tokens == s.drafts for s in drafted)  # gamma 1
    assert engine.statistics().kv_used_blocks == 0
