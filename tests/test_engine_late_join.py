"""Late hand-over (engine Rule 2): an arrival stamped before a step boundary but handed to
the engine after it joins the step in flight, exactly as if it had been on time — when the
step has room and nothing else waits.

The serve runtime stamps a request when the server received it and hands it to the engine
a little later (parsing, admission, a task switch); without this a request that arrived
just before a boundary would wait one step more than the model says.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_lab.core.engine import Engine, StepEvents
from tests.engine_util import assert_blocks_conserved, deployment, finished, run, spec


def token_times(events: list[StepEvents]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for ev in events:
        for rid, n in ev.tokens:
            out.setdefault(rid, []).extend([ev.time] * n)
    return out


def step_started_at(eng: Engine, t: float) -> list[StepEvents]:
    """Run a first request so that a step starts at simulated time ``t`` and is in flight."""
    eng.advance_to(t)
    eng.submit(spec(40, 30, arrival_time=t))
    return run(eng, until=t)


def third_boundary() -> float:
    """The start of the third step of a lone request A (40-token prompt) submitted at 0."""
    eng = Engine(deployment())
    eng.submit(spec(40, 30))
    starts = [ev.step.start for ev in run(eng) if ev.step is not None]
    return starts[2]


def test_a_late_arrival_joins_the_step_in_flight_as_if_it_were_on_time() -> None:
    """B is stamped 1 us before a boundary of A's decoding but reaches the engine after
    it: A's and B's token times equal those of a run where B reached it on time, and B's
    E2E counts from its stamp."""
    b = third_boundary()
    runs = []
    for handed_over in (b - 1e-7, b):  # on time, then after the boundary was handled
        eng = Engine(deployment())
        a = eng.submit(spec(40, 30))
        events = run(eng, until=handed_over)
        late = eng.submit(spec(25, 5, arrival_time=b - 1e-6))
        events += run(eng)
        assert_blocks_conserved(eng)
        runs.append((token_times(events), a, late, finished(events)))
    (on_time, a1, b1, _), (handed_late, a2, b2, fin) = runs
    assert handed_late[b2] == on_time[b1]
    assert handed_late[a2] == on_time[a1]
    assert fin[b2].arrival_time == b - 1e-6


def test_an_arrival_stamped_after_the_boundary_waits_for_the_next_one() -> None:
    eng = Engine(deployment())
    step_started_at(eng, 1.0)
    first_end = eng.next_event_time()
    b = eng.submit(spec(25, 5, arrival_time=1.0001))
    events = run(eng)
    assert eng.next_event_time() is None
    assert first_end is not None and token_times(events)[b][0] > first_end


def test_a_late_arrival_does_not_pass_a_waiting_request() -> None:
    """With a request already waiting (the cap is full) the late one queues behind it."""
    eng = Engine(deployment(max_num_seqs=1))
    step_started_at(eng, 1.0)
    end = eng.next_event_time()
    waiting = eng.submit(spec(10, 2, arrival_time=0.99))
    late = eng.submit(spec(10, 2, arrival_time=0.99))
    run(eng, until=1.0)
    assert eng.next_event_time() == end  # the step in flight was not re-priced
    events = run(eng)
    assert token_times(events)[waiting][0] < token_times(events)[late][0]


def test_a_late_arrival_over_the_cap_waits() -> None:
    eng = Engine(deployment(max_num_seqs=1))
    step_started_at(eng, 1.0)
    end = eng.next_event_time()
    b = eng.submit(spec(10, 2, arrival_time=0.99))
    run(eng, until=1.0)
    assert eng.next_event_time() == end
    assert eng.statistics().waiting == 1
    assert b in token_times(run(eng))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 40), st.floats(0.0, 0.3)),
        min_size=1,
        max_size=25,
    ),
    st.floats(0.0, 0.01),
    st.integers(0, 2**31),
)
def test_late_hand_over_conserves_blocks_and_completes_everything(
    reqs: list[tuple[int, int, float]], delay: float, seed: int
) -> None:
    """Arrivals handed over ``delay`` after their stamp (the engine runs every event up to
    then first, as the serve runtime does): blocks are conserved at every step and every
    request completes with its full length."""
    rng = np.random.default_rng(seed)
    eng = Engine(
        deployment(
            blocks=60,
            max_num_batched_tokens=256,
            max_num_seqs=int(rng.integers(1, 8)),
            long_prefill_token_threshold=int(rng.integers(0, 100)),
        )
    )
    emitted: dict[int, int] = {}
    ids: dict[int, int] = {}

    def step_until(limit: float | None) -> None:
        while (t := eng.next_event_time()) is not None and (limit is None or t <= limit):
            ev = eng.step()
            for rid, n in ev.tokens:
                emitted[rid] = emitted.get(rid, 0) + n
            assert_blocks_conserved(eng)

    for prompt, max_tokens, stamp in sorted(reqs, key=lambda r: r[2]):
        step_until(stamp + delay)
        if eng.is_idle():
            eng.advance_to(stamp + delay)
        ids[eng.submit(spec(prompt, max_tokens, arrival_time=stamp))] = max_tokens
    step_until(None)
    assert eng.is_idle()
    assert emitted == ids
    for w in eng.workers:
        assert w.free_blocks == w.total_blocks


# ------------------------------------------------------------------ frontend latency (Rule 7)


def test_a_frontend_latency_delays_the_engine_and_counts_in_ttft_and_e2e() -> None:
    """With ``frontend_latency`` L a request arriving at t enters the engine at t + L:
    every step and token of a lone request moves by L, and its ``Finished`` reports the
    arrival t, so TTFT and E2E grow by exactly L."""
    latency = 0.0025
    runs = []
    for frontend in (0.0, latency):
        eng = Engine(deployment(frontend_latency=frontend))
        rid = eng.submit(spec(100, 4, arrival_time=2.0))
        events = run(eng)
        runs.append((finished(events)[rid], token_times(events)[rid], events))
    (f0, t0, _), (f1, t1, events) = runs
    assert f1.arrival_time == 2.0
    assert f1.first_scheduled_time == pytest.approx(2.0 + latency, abs=1e-12)
    assert f1.first_token_time - f1.arrival_time == pytest.approx(
        f0.first_token_time - f0.arrival_time + latency, abs=1e-12
    )
    assert f1.finish_time == pytest.approx(f0.finish_time + latency, abs=1e-12)
    assert t1 == pytest.approx([t + latency for t in t0], abs=1e-12)
    assert min(ev.step.start for ev in events if ev.step is not None) == pytest.approx(
        2.0 + latency, abs=1e-12
    )


def test_a_frontend_latency_applies_to_joining_a_step_in_flight() -> None:
    """Rule 2 with Rule 7: a request handed over late joins the step in flight only if
    its arrival plus the frontend latency precedes the step's start. Stamped 1 us before a
    boundary, it waits for the next one once a 10 us latency puts it after the boundary."""
    b = third_boundary()
    firsts = []
    for frontend in (0.0, 1e-5):
        eng = Engine(deployment(frontend_latency=frontend))
        eng.submit(spec(40, 30))
        events = run(eng, until=b)
        late = eng.submit(spec(25, 5, arrival_time=b - 1e-6))
        events += run(eng)
        assert_blocks_conserved(eng)
        firsts.append((token_times(events)[late][0], finished(events)[late].arrival_time))
    (joined, arrival0), (waited, arrival1) = firsts
    assert arrival0 == arrival1 == b - 1e-6
    assert waited > joined
