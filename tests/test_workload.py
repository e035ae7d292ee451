"""The arrival generator: determinism, the shape of each arrival pattern, length sampling."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from inference_lab.core.config import FixedDist, LognormalDist, NormalDist, UniformDist, Workload
from inference_lab.errors import ConfigError
from inference_lab.workload import (
    CHUNK,
    Arrival,
    ArrivalGenerator,
    ClosedLoopGenerator,
    OpenLoopGenerator,
    make_generator,
)


def workload(**overrides: Any) -> Workload:
    fields: dict[str, Any] = {
        "arrival_pattern": "poisson",
        "arrival_rate": 4.0,
        "input_len_dist": LognormalDist(mean=6.0, std_dev=0.5),
        "output_len_dist": LognormalDist(mean=5.0, std_dev=0.5),
        "num_requests": 200,
        "seed": 42,
    }
    fields.update(overrides)
    return Workload(**fields)


def times(wl: Workload, seed: int | None = None) -> np.ndarray[Any, Any]:
    return np.array([a.time for a in make_generator(wl, seed).initial()])


@pytest.mark.parametrize("pattern", ["poisson", "uniform", "burst", "batched"])
def test_same_seed_gives_the_same_arrivals(pattern: str) -> None:
    """Two generators built from the same workload and seed produce identical requests."""
    wl = workload(arrival_pattern=pattern)
    first = make_generator(wl).initial()
    second = make_generator(wl).initial()
    assert len(first) == 200
    assert first == second


@pytest.mark.parametrize("pattern", ["poisson", "uniform", "burst", "batched"])
def test_different_seed_gives_different_requests(pattern: str) -> None:
    """Changing the seed changes the sampled lengths (and, where random, the times)."""
    wl = workload(arrival_pattern=pattern)
    a = make_generator(wl).initial()
    b = make_generator(wl, seed=43).initial()
    assert [x.prompt_tokens for x in a] != [x.prompt_tokens for x in b]
    assert [x.output_len for x in a] != [x.output_len for x in b]
    if pattern in ("poisson", "burst"):
        assert [x.time for x in a] != [x.time for x in b]


def test_seed_argument_overrides_the_workload_seed() -> None:
    """`seed=` (the CLI's --seed) gives exactly the workload-with-that-seed's requests."""
    wl = workload()
    assert (
        make_generator(wl, seed=7).initial() == make_generator(attrs.evolve(wl, seed=7)).initial()
    )
    assert make_generator(wl, seed=7).initial() != make_generator(wl).initial()


def test_first_requests_do_not_depend_on_num_requests() -> None:
    """Samples come in fixed chunks, so a longer run starts with the shorter run's requests."""
    short = make_generator(workload(num_requests=100)).initial()
    long = make_generator(workload(num_requests=CHUNK * 2 + 5)).initial()
    assert len(long) == CHUNK * 2 + 5
    assert long[:100] == short


def test_uniform_gaps_are_exactly_one_over_rate() -> None:
    """uniform: arrival k is at k / rate, starting at 0."""
    t = times(workload(arrival_pattern="uniform", arrival_rate=8.0, num_requests=3000))
    assert len(t) == 3000
    assert t[0] == 0.0
    np.testing.assert_array_equal(t, np.arange(3000) / 8.0)
    np.testing.assert_allclose(np.diff(t), 0.125, rtol=1e-12)


def test_batched_arrivals_are_all_at_zero() -> None:
    """batched: every request arrives at t = 0."""
    t = times(workload(arrival_pattern="batched", num_requests=1000))
    assert len(t) == 1000
    assert not t.any()


def test_poisson_gaps_are_exponential_with_mean_one_over_rate() -> None:
    """poisson: over many samples the mean gap is 1/rate and the gaps' CV is ~1 (not uniform)."""
    t = times(workload(arrival_pattern="poisson", arrival_rate=4.0, num_requests=20_000))
    gaps = np.diff(t)
    assert t[0] == 0.0
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


def test_burst_gaps_fall_in_the_two_ranges_with_probability_0_2() -> None:
    """burst: a gap is U(1 ms, 10 ms) with probability 0.2, else U(0.5 s, 2 s)."""
    gaps = np.diff(times(workload(arrival_pattern="burst", num_requests=10_001)))
    short = (gaps >= 0.001) & (gaps <= 0.010)
    long = (gaps >= 0.5) & (gaps <= 2.0)
    assert np.all(short | long)
    assert short.mean() == pytest.approx(0.2, abs=0.02)
    assert gaps[short].mean() == pytest.approx(0.0055, rel=0.05)
    assert gaps[long].mean() == pytest.approx(1.25, rel=0.03)


@pytest.mark.parametrize("pattern", ["uniform", "poisson", "burst"])
def test_duration_stops_arrivals_before_the_deadline(pattern: str) -> None:
    """duration_secs: no arrival at or after it; without num_requests it alone bounds the run."""
    wl = workload(arrival_pattern=pattern, arrival_rate=10.0, num_requests=None, duration_secs=50.0)
    t = times(wl)
    assert len(t) > 0
    assert t.max() < 50.0
    if pattern == "uniform":
        assert len(t) == 500
    if pattern == "poisson":
        assert len(t) == pytest.approx(500, rel=0.2)
        assert t.max() > 45.0  # it did run to (near) the deadline, not stop early


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_requests": 3 * CHUNK + 17},
        {"num_requests": 2 * CHUNK},
        {"num_requests": None, "duration_secs": 700.0},
        {"arrival_pattern": "burst", "num_requests": CHUNK + 1},
        {"arrival_pattern": "uniform", "num_requests": 2 * CHUNK - 1, "duration_secs": 400.0},
    ],
)
def test_chunks_are_the_arrays_cut_where_they_were_drawn(overrides: dict[str, Any]) -> None:
    """``chunks()`` (a sharded simulation's stream) holds exactly ``arrays()``, in order,
    in pieces of at most CHUNK, whichever limit ends the workload."""
    wl = workload(**overrides)
    whole = OpenLoopGenerator(wl, np.random.default_rng(wl.seed)).arrays()
    parts = list(OpenLoopGenerator(wl, np.random.default_rng(wl.seed)).chunks())
    assert parts and all(0 < len(p.times) <= CHUNK for p in parts)
    for k in range(3):
        assert np.array_equal(np.concatenate([p[k] for p in parts]), whole[k])


@pytest.mark.parametrize("pattern", ["poisson", "uniform", "burst"])
def test_a_stream_resumed_from_a_mark_goes_on_as_it_went(pattern: str) -> None:
    """``marked_chunks`` marks the first chunk and every ``every``-th; a generator resumed
    from any mark draws exactly the chunks that followed it."""
    wl = workload(arrival_pattern=pattern, num_requests=7 * CHUNK + 5)
    marked = list(OpenLoopGenerator(wl, np.random.default_rng(wl.seed)).marked_chunks(3))
    marks = [(i, m) for i, (m, _) in enumerate(marked) if m is not None]
    assert [i for i, _ in marks] == [0, 3, 6]
    for i, mark in marks:
        again = list(OpenLoopGenerator.resume(wl, mark).marked_chunks(start=mark))
        assert len(again) == len(marked) - i
        for (_, a), (_, b) in zip(again, marked[i:], strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_num_requests_caps_a_duration_bounded_workload() -> None:
    """With both limits the first one reached wins."""
    wl = workload(arrival_pattern="uniform", arrival_rate=10.0, num_requests=20, duration_secs=50.0)
    assert len(times(wl)) == 20


@pytest.mark.parametrize(
    "dist",
    [
        NormalDist(mean=0.0, std_dev=5.0),
        LognormalDist(mean=0.0, std_dev=1.0),
        UniformDist(min=1, max=3),
        FixedDist(value=1.7),
    ],
    ids=["normal", "lognormal", "uniform", "fixed"],
)
def test_lengths_are_integers_at_least_one(dist: Any) -> None:
    """Sampled lengths are floored to ints >= 1, even where the distribution goes below 1."""
    arrivals = make_generator(
        workload(input_len_dist=dist, output_len_dist=dist, num_requests=2000)
    ).initial()
    for values in ([a.prompt_tokens for a in arrivals], [a.output_len for a in arrivals]):
        assert all(type(v) is int for v in values)
        assert min(values) == 1


def test_lengths_follow_the_distribution() -> None:
    """A lognormal(6.9, 0.7) prompt has median ~ e^6.9; fixed lengths are exact."""
    arrivals = make_generator(
        workload(
            input_len_dist=LognormalDist(mean=6.9, std_dev=0.7),
            output_len_dist=FixedDist(value=256),
            num_requests=5000,
        )
    ).initial()
    prompts = np.array([a.prompt_tokens for a in arrivals])
    assert np.median(prompts) == pytest.approx(np.exp(6.9), rel=0.05)
    assert {a.output_len for a in arrivals} == {256}


def closed(**overrides: Any) -> ClosedLoopGenerator:
    fields: dict[str, Any] = {
        "arrival_pattern": "closed_loop",
        "num_concurrent_users": 8,
        "closed_loop_jitter_secs": 0.05,
        "num_requests": 20,
    }
    fields.update(overrides)
    gen = make_generator(workload(**fields))
    assert isinstance(gen, ClosedLoopGenerator)
    return gen


def test_closed_loop_starts_one_request_per_user_within_the_jitter() -> None:
    """closed_loop: N first arrivals, one per user, at U(0, jitter)."""
    first = closed().initial()
    assert [a.user for a in first] == list(range(8))
    ts = [a.time for a in first]
    assert all(0.0 <= t < 0.05 for t in ts)
    assert len(set(ts)) == 8  # jittered, not all equal
    assert {a.time for a in closed(closed_loop_jitter_secs=0.0).initial()} == {0.0}


def test_closed_loop_next_request_arrives_at_the_completion() -> None:
    """A user's next request arrives at the time its previous one ended, until num_requests."""
    gen = closed()
    first = gen.initial()
    follow = [gen.on_complete(3, 1.5 + i) for i in range(12)]
    assert all(isinstance(a, Arrival) for a in follow)
    assert [a.time for a in follow if a is not None] == [1.5 + i for i in range(12)]
    assert {a.user for a in follow if a is not None} == {3}
    assert len(first) + len(follow) == 20
    assert gen.on_complete(0, 20.0) is None  # num_requests reached


def test_closed_loop_with_fewer_requests_than_users() -> None:
    """num_requests < users: only num_requests users ever send anything."""
    gen = closed(num_requests=3)
    assert len(gen.initial()) == 3
    assert gen.on_complete(0, 1.0) is None


def test_closed_loop_stops_at_the_duration() -> None:
    """duration_secs: a completion at or after the deadline gets no follow-up."""
    gen = closed(num_requests=None, duration_secs=10.0)
    gen.initial()
    assert gen.on_complete(0, 9.99) is not None
    assert gen.on_complete(0, 10.0) is None


def test_closed_loop_is_deterministic() -> None:
    """Same seed, same sequence of completions -> same requests; another seed differs."""

    def drive(gen: ArrivalGenerator) -> list[Arrival | None]:
        return [*gen.initial(), *(gen.on_complete(i % 8, float(i)) for i in range(15))]

    wl = workload(
        arrival_pattern="closed_loop",
        num_concurrent_users=8,
        closed_loop_jitter_secs=0.05,
        num_requests=20,
    )
    assert drive(make_generator(wl)) == drive(make_generator(wl))
    assert drive(make_generator(wl)) != drive(make_generator(wl, seed=1))


def test_open_loop_generator_rejects_closed_loop_workloads() -> None:
    """The open-loop generator refuses a pattern it cannot produce (ConfigError, not a crash)."""
    wl = workload(arrival_pattern="closed_loop", num_concurrent_users=2)
    with pytest.raises(ConfigError):
        OpenLoopGenerator(wl, np.random.default_rng(0))
