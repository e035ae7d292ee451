"""Session workloads and rate schedules in the simulator's arrival generation
(``inference_lab/workload/``; the ``[sessions]`` and ``[rate_schedule]``
tables of ``docs/configuration.md``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from inference_lab.core.config import (
    ExponentialTime,
    FixedDist,
    FixedTime,
    SessionConfig,
    UniformDist,
    Workload,
    load_workload,
)
from inference_lab.errors import ConfigError
from inference_lab.traffic.schedules import PiecewiseRate, SquareRate
from inference_lab.workload import Arrival, SessionGenerator, make_generator


def sessions_workload(**overrides: Any) -> Workload:
    sessions = {
        "num_sessions": 5,
        "turns": FixedDist(value=3),
        "think_time": FixedTime(value=2.0),
        "system_prompt_tokens": 100,
    }
    sessions.update(overrides.pop("sessions", {}))
    fields: dict[str, Any] = {
        "arrival_pattern": "poisson",
        "arrival_rate": 1.0,
        "input_len_dist": UniformDist(min=10, max=50),
        "output_len_dist": UniformDist(min=5, max=40),
        "seed": 42,
        "sessions": SessionConfig(**sessions),
    }
    fields.update(overrides)
    return Workload(**fields)


def generator(wl: Workload, block_size: int | None = 16) -> SessionGenerator:
    gen = make_generator(wl, block_size=block_size)
    assert isinstance(gen, SessionGenerator)
    return gen


def drive(gen: SessionGenerator, finish_after: float = 1.0) -> list[Arrival]:
    """Every arrival, each request finishing ``finish_after`` s after it arrived, in
    arrival order (a stand-in for the engine)."""
    pending = sorted(gen.initial(), key=lambda a: a.time)
    out = []
    while pending:
        a = pending.pop(0)
        out.append(a)
        nxt = gen.follow_up(a, a.time + finish_after, False)
        if nxt is not None:
            pending.append(nxt)
            pending.sort(key=lambda x: x.time)
    return out


def test_each_turn_resends_the_conversation_after_a_think_time() -> None:
    """Turn k + 1 arrives its think time after turn k finished, its prompt turn k's prompt
    + answer + new user tokens; a session ends after its turns."""
    arrivals = drive(generator(sessions_workload()))
    assert len(arrivals) == 5 * 3
    by_session: dict[int, list[Arrival]] = {}
    for a in arrivals:
        by_session.setdefault(a.session, []).append(a)
    assert sorted(by_session) == list(range(5))
    for turns in by_session.values():
        assert [a.turn for a in turns] == [0, 1, 2]
        assert turns[0].prompt_tokens > 100  # the system prompt and the first user tokens
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.time == pytest.approx(prev.time + 1.0 + 2.0)
            user = nxt.prompt_tokens - prev.prompt_tokens - prev.output_len
            assert 10 <= user <= 50
            assert nxt.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
            assert len(prev.block_hashes) == (prev.prompt_tokens + prev.output_len) // 16


def test_a_shared_system_prompt_is_the_same_blocks_in_every_session() -> None:
    """100 shared tokens are six whole 16-token blocks common to every session's first
    turn; with shared_system_prompt = false the sessions share nothing."""
    first = generator(sessions_workload()).initial()
    assert len({a.block_hashes[:6] for a in first}) == 1
    assert len({a.block_hashes[6] for a in first}) == 5
    own = generator(sessions_workload(sessions={"shared_system_prompt": False})).initial()
    assert len({a.block_hashes[0] for a in own}) == 5


def test_no_hashes_without_a_block_size() -> None:
    """A deployment that does not cache prefixes gets requests without hashes."""
    arrivals = drive(generator(sessions_workload(), block_size=None))
    assert all(a.block_hashes == () for a in arrivals)


def test_open_loop_sessions_start_by_the_arrival_pattern() -> None:
    """uniform at 0.5 sessions/s: the sessions start at 0, 2, 4, ...; duration_secs stops
    the starts, not the turns of sessions already started."""
    wl = sessions_workload(arrival_pattern="uniform", arrival_rate=0.5)
    assert [a.time for a in generator(wl).initial()] == [0.0, 2.0, 4.0, 6.0, 8.0]
    short = attrs.evolve(wl, duration_secs=5.0)
    arrivals = drive(generator(short))
    assert {a.session for a in arrivals} == {0, 1, 2}
    assert len(arrivals) == 9


def test_num_requests_caps_the_turns() -> None:
    arrivals = drive(generator(sessions_workload(num_requests=7)))
    assert len(arrivals) == 7


def test_closed_loop_users_run_sessions_back_to_back() -> None:
    """closed_loop with 2 users: each user's next session starts when its previous
    session's last turn ended; 5 sessions in all."""
    wl = sessions_workload(arrival_pattern="closed_loop", num_concurrent_users=2)
    gen = generator(wl)
    arrivals = drive(gen)
    assert len({a.session for a in arrivals}) == 5 and len(arrivals) == 15
    assert {a.user for a in arrivals} == {0, 1}
    for user in (0, 1):
        mine = [a for a in arrivals if a.user == user]
        for prev, nxt in zip(mine, mine[1:], strict=False):
            if nxt.session != prev.session:
                assert nxt.turn == 0 and prev.turn == 2
                assert nxt.time == pytest.approx(prev.time + 1.0)  # no think time


def test_a_refused_turn_ends_its_session() -> None:
    """A refused turn (the deployment can never run it) has no follow-up in an open loop;
    in a closed loop its user starts the next session."""
    gen = generator(sessions_workload())
    first = gen.initial()[0]
    assert gen.follow_up(first, first.time, True) is None
    closed = generator(sessions_workload(arrival_pattern="closed_loop", num_concurrent_users=1))
    (a,) = closed.initial()
    nxt = closed.follow_up(a, 3.0, True)
    assert nxt is not None and (nxt.session, nxt.turn, nxt.time) == (1, 0, 3.0)


def test_sessions_are_deterministic_and_do_not_depend_on_their_number() -> None:
    """Same seed, same sessions; the first sessions' plans and starts do not depend on
    num_sessions; another seed differs."""
    few = drive(generator(sessions_workload()))
    again = drive(generator(sessions_workload()))
    many = drive(generator(sessions_workload(sessions={"num_sessions": 50})))
    assert few == again
    first_three = [a for a in few if a.session < 3]
    assert first_three == [a for a in many if a.session < 3][: len(first_three)]
    other = drive(generator(sessions_workload(seed=7)))
    assert other != few


def test_think_time_distributions_are_seconds_not_lengths() -> None:
    """An exponential think time is a float >= 0 (never floored to a token count)."""
    wl = sessions_workload(sessions={"think_time": ExponentialTime(mean=0.25)})
    arrivals = drive(generator(wl), finish_after=0.0)
    gaps = [
        b.time - a.time
        for a, b in zip(arrivals, arrivals[1:], strict=False)
        if a.session == b.session
    ]
    assert gaps and any(0 < g < 1 and g != int(g) for g in gaps)


# ------------------------------------------------------------------ rate schedules


def test_uniform_arrivals_follow_a_step_schedule_exactly() -> None:
    """uniform with rate 2/s for 5 s then 1/s: arrival k at k / 2 up to 10, then 5 + (k -
    10)."""
    wl = Workload(
        arrival_pattern="uniform",
        input_len_dist=FixedDist(value=10),
        output_len_dist=FixedDist(value=5),
        num_requests=14,
        seed=1,
        rate_schedule=PiecewiseRate(points=((0.0, 2.0), (5.0, 1.0))),
    )
    times = [a.time for a in make_generator(wl).initial()]
    assert times == pytest.approx([k / 2 for k in range(11)] + [6.0, 7.0, 8.0], abs=1e-9)


def test_poisson_arrivals_follow_a_square_schedule() -> None:
    """A square wave of 40/s for the first quarter of each 10 s period and 4/s after:
    over 200 s the arrivals split about 40 * 2.5 : 4 * 7.5 = 10 : 3 between the phases."""
    wl = Workload(
        arrival_pattern="poisson",
        input_len_dist=FixedDist(value=10),
        output_len_dist=FixedDist(value=5),
        duration_secs=200.0,
        seed=3,
        rate_schedule=SquareRate(low=4.0, high=40.0, period_secs=10.0, duty=0.25),
    )
    times = np.array([a.time for a in make_generator(wl).initial()])
    assert times.max() < 200.0
    high = np.sum((times % 10.0) < 2.5)
    low = len(times) - high
    assert len(times) == pytest.approx(200 / 10 * (100 + 30), rel=0.05)
    assert high / low == pytest.approx(10 / 3, rel=0.1)


def test_a_schedule_whose_rate_ends_stops_the_arrivals() -> None:
    """Rate 2/s for 3 s then 0: six arrivals however many were asked for."""
    wl = Workload(
        arrival_pattern="uniform",
        input_len_dist=FixedDist(value=10),
        output_len_dist=FixedDist(value=5),
        num_requests=100,
        seed=1,
        rate_schedule=PiecewiseRate(points=((0.0, 2.0), (3.0, 0.0))),
    )
    times = [a.time for a in make_generator(wl).initial()]
    assert times == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0], abs=1e-9)


def test_without_a_schedule_open_loop_arrivals_are_unchanged() -> None:
    """The schedule code path is not taken without a schedule: a poisson workload's
    arrivals equal the cumulative sums of its exponential gaps (Rule 4)."""
    wl = Workload(
        arrival_pattern="poisson",
        arrival_rate=3.0,
        input_len_dist=FixedDist(value=10),
        output_len_dist=FixedDist(value=5),
        num_requests=50,
        seed=9,
    )
    times = [a.time for a in make_generator(wl).initial()]
    gaps = np.random.default_rng(9).exponential(1 / 3.0, 1024)
    assert times == pytest.approx(np.concatenate(([0.0], np.cumsum(gaps[:49]))).tolist())


# ------------------------------------------------------------------ the TOML tables


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "w.toml"
    path.write_text(text)
    return path


BASE = """
arrival_pattern = "poisson"
arrival_rate = 2.0
input_len_dist = { type = "fixed", value = 100 }
output_len_dist = { type = "fixed", value = 10 }
seed = 1
"""


def test_sessions_and_schedule_tables_load(tmp_path: Path) -> None:
    """[sessions] with a think-time distribution, [rate_schedule] with a points file read
    relative to the workload file (a header line skipped)."""
    (tmp_path / "rates.csv").write_text("time_s,rate\n0,1.5\n60,3\n")
    wl = load_workload(
        write(
            tmp_path,
            BASE
            + """
[sessions]
num_sessions = 10
turns = { type = "uniform", min = 2, max = 6 }
think_time = { type = "lognormal", mean = 1.0, std_dev = 0.5 }
system_prompt_tokens = 512

[rate_schedule]
type = "piecewise"
points_file = "rates.csv"
interpolation = "linear"
""",
        )
    )
    assert wl.sessions is not None and wl.sessions.num_sessions == 10
    assert wl.sessions.shared_system_prompt is True
    assert isinstance(wl.rate_schedule, PiecewiseRate)
    assert wl.rate_schedule.points == ((0.0, 1.5), (60.0, 3.0))
    assert wl.rate_schedule.points_file == str(tmp_path / "rates.csv")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            "[sessions]\nturns = { type = 'fixed', value = 2 }\nfoo = 1\n",
            "sessions.foo: unknown key",
        ),
        (
            "[sessions]\nturns = { type = 'fixed', value = 2 }\n"
            "think_time = { type = 'fixed', value = -1 }\n",
            "sessions.think_time.value: must be >= 0",
        ),
        (
            "[sessions]\nturns = { type = 'fixed', value = 2 }\n"
            "think_time = { type = 'weibull', mean = 1 }\n",
            "sessions.think_time.type: must be one of fixed, uniform, exponential, lognormal",
        ),
        ("[sessions]\nnum_sessions = 3\n", "sessions.turns: missing required key"),
        (
            "[rate_schedule]\ntype = 'sine'\nmean = 1\namplitude = 2\nperiod_secs = 10\n",
            "rate_schedule.amplitude: must be <= mean",
        ),
        (
            "[rate_schedule]\ntype = 'piecewise'\npoints = [[1, 2]]\n",
            "rate_schedule.points: the first point must be at time 0",
        ),
        (
            "[rate_schedule]\ntype = 'piecewise'\npoints_file = 'nowhere.csv'\n",
            "rate_schedule.points_file: no such file",
        ),
    ],
)
def test_bad_tables_are_one_line_errors(tmp_path: Path, extra: str, message: str) -> None:
    text = BASE.replace("seed = 1\n", "seed = 1\nnum_requests = 5\n") + extra
    with pytest.raises(ConfigError) as info:
        load_workload(write(tmp_path, text))
    assert message in str(info.value)
    assert str(info.value).startswith(str(tmp_path))


def test_a_schedule_needs_poisson_or_uniform(tmp_path: Path) -> None:
    text = (
        BASE.replace('"poisson"', '"burst"')
        + "num_requests = 5\n[rate_schedule]\ntype = 'square'\nlow = 1\nhigh = 2\nperiod_secs = 4\n"
    )
    with pytest.raises(ConfigError, match="rate_schedule: applies to arrival_pattern poisson"):
        load_workload(write(tmp_path, text))


def test_a_bad_points_file_line_is_named(tmp_path: Path) -> None:
    (tmp_path / "rates.csv").write_text("0,1\n10,fast\n")
    text = (
        BASE + "num_requests = 5\n[rate_schedule]\ntype = 'piecewise'\npoints_file = 'rates.csv'\n"
    )
    with pytest.raises(ConfigError) as info:
        load_workload(write(tmp_path, text))
    assert str(info.value) == (
        f"{tmp_path / 'rates.csv'}:2: must be two numbers time_s,rate, got '10,fast'"
    )


def test_sessions_need_a_bound(tmp_path: Path) -> None:
    text = BASE + "[sessions]\nturns = { type = 'fixed', value = 2 }\n"
    with pytest.raises(ConfigError, match="sessions: set sessions.num_sessions"):
        load_workload(write(tmp_path, text))
