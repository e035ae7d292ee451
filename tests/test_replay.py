"""Replaying traffic against a server: session files (``traffic/sessions.py``), ``sim
--write-sessions`` and ``inference-lab load --sessions`` / ``--trace``
(``client/replay.py``).

The replays run against the real server on ``127.0.0.1:0`` (real sockets, the real
clock, a machine that may be busy): they assert what holds however late anything runs
-- outcomes, cached tokens as the server reports them, orderings and lower bounds of
times. How close the client's TTFT comes to the simulator's is measured by
``scripts/bench_sessions_serve.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from inference_lab import cli
from inference_lab.client.http import Origin, Transport
from inference_lab.client.replay import (
    ReplayConfig,
    ReplayResult,
    load_traffic,
    prompt_text,
    run_replay,
    summarize_replay,
    trace_prompt,
)
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.errors import ConfigError
from inference_lab.serve import ServeSettings, create_app, get_state
from inference_lab.serve.server import bind_socket, serve_app
from inference_lab.traffic.sessions import SessionRecord, Turn, read_sessions, write_sessions
from inference_lab.traffic.traces import read_trace
from inference_lab.workload import SessionGenerator, make_rng, session_records

from .conftest import CONFIG_FILES, GPT, ROOT
from .fake_openai_server import FakeConfig, MemoryFake

WORKLOADS = ROOT / "configs" / "workloads"


# -- session files ------------------------------------------------------------------------


def test_a_session_file_round_trips(tmp_path: Path) -> None:
    sessions = [
        SessionRecord(
            session=0,
            start=0.5,
            system_prompt_tokens=100,
            shared_system_prompt=True,
            turns=(Turn(10, 20, 0.0), Turn(5, 7, 1.25)),
        ),
        SessionRecord(
            session=1,
            start=None,
            system_prompt_tokens=0,
            shared_system_prompt=False,
            turns=(Turn(3, 4),),
        ),
    ]
    path = tmp_path / "s.jsonl"
    assert write_sessions(path, sessions) == 2
    assert read_sessions(path) == tuple(sessions)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"session": 0, "turns": []}', "turns: must be a non-empty list"),
        (
            '{"session": 0, "turns": [{"user_tokens": 0, "output_tokens": 1}]}',
            "turns[0].user_tokens: must be an integer >= 1, got 0",
        ),
        (
            '{"session": 0, "start": -1, "turns": [{"user_tokens": 1, "output_tokens": 1}]}',
            "start: must be a number of seconds >= 0, got -1",
        ),
        (
            '{"session": 0, "turns": [{"user_tokens": 1, "output_tokens": 1, "think_time": "x"}]}',
            "turns[0].think_time: must be a number of seconds >= 0",
        ),
        ("[1]", "must be a JSON object"),
    ],
)
def test_a_bad_session_line_is_one_error_naming_file_line_and_field(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "s.jsonl"
    good = '{"session": 0, "turns": [{"user_tokens": 1, "output_tokens": 1}]}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(ConfigError) as err:
        read_sessions(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_sim_writes_the_sessions_it_simulates(tmp_path: Path) -> None:
    """``sim --write-sessions``: the plans of the run, in session order, with the open
    loop's start times; the first plan is the one the simulator's own generator draws."""
    path = tmp_path / "s.jsonl"
    code = cli.main(
        [
            "sim",
            "--config",
            "Llama-3.1-8B-Instruct",
            "--hardware",
            "h100",
            "--workload",
            "chat-sessions-200",
            "--write-sessions",
            str(path),
            "-q",
        ]
    )
    assert code == 0
    sessions = read_sessions(path)
    workload = load_workload(WORKLOADS / "chat-sessions-200.toml")
    assert len(sessions) == 200 and sum(len(s.turns) for s in sessions) == 1600
    gen = SessionGenerator(workload, make_rng(workload), None)
    starts = gen._start_times()
    first = gen._plan()
    assert sessions[0].turns == first.turns and sessions[0].system_prompt_tokens == 2048
    assert [s.start for s in sessions] == starts[:200]


def test_a_closed_loops_sessions_have_no_start() -> None:
    workload = load_workload(WORKLOADS / "agent-loop-32.toml")
    sessions = session_records(workload)
    assert sessions and all(s.start is None for s in sessions)


# -- prompts ------------------------------------------------------------------------------


def test_prompt_texts_are_four_bytes_a_token_and_open_with_their_tag() -> None:
    text = prompt_text("[session 3 turn 1] ", 50)
    assert len(text.encode()) == 200 and text.startswith("[session 3 turn 1] ")
    assert len(prompt_text("[a long tag that is longer] ", 1)) == len(
        "[a long tag that is longer] "
    )


def test_mooncake_requests_sharing_hash_ids_share_their_leading_text() -> None:
    trace = read_trace(WORKLOADS / "mooncake-sample.jsonl")
    a, b = trace.requests[0], trace.requests[1]  # hash_ids [0, 1] and [0, 1, 2, 3]
    ta, tb = trace_prompt(a), trace_prompt(b)
    assert len(ta) == 4 * a.input_tokens and len(tb) == 4 * b.input_tokens
    assert tb.startswith(ta[: 2 * 2048 if a.input_tokens >= 1024 else len(ta)])


# -- against the real server ------------------------------------------------------------------


async def start(nursery: trio.Nursery, **scheduler: Any) -> tuple[str, Any]:
    dep = load_deployment(CONFIG_FILES[GPT], "b200")
    dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, **scheduler))
    app = create_app(ServeSettings(deployments=(dep,)))
    urls: list[str] = await nursery.start(serve_app, app, bind_socket("127.0.0.1", 0))
    return urls[0], get_state(app)


def sessions_file(tmp_path: Path, starts: list[float | None]) -> Path:
    sessions = [
        SessionRecord(
            session=i,
            start=start,
            system_prompt_tokens=300,
            shared_system_prompt=True,
            turns=(Turn(60, 30), Turn(40, 20, 0.05), Turn(50, 10, 0.05)),
        )
        for i, start in enumerate(starts)
    ]
    path = tmp_path / "s.jsonl"
    write_sessions(path, sessions)
    return path


def by_session(result: ReplayResult) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for r in result.records:
        out.setdefault(r.session, []).append(r)
    return {k: sorted(v, key=lambda r: r.turn) for k, v in out.items()}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_sessions_resend_the_conversation_and_hit_the_cache(
    nursery: trio.Nursery, tmp_path: Path, endpoint: str
) -> None:
    """Every turn resends the conversation so far: each later turn's prompt is longer
    than the previous prompt and answer, and the server reports as cached more than the
    previous turn's prompt; a turn starts no earlier than its think time after the
    previous answer ended; the server admitted every turn."""
    with trio.fail_after(60):
        url, state = await start(nursery)
        path = sessions_file(tmp_path, [0.0, 0.02, 0.04])
        config = ReplayConfig(url=url, model=GPT, sessions=path, endpoint=endpoint)
        result = await run_replay(config, load_traffic(config))
    assert [r.outcome for r in result.records] == ["ok"] * 9
    assert state.runtimes[GPT].snapshot().admitted == 9
    for turns in by_session(result).values():
        assert turns[0].start >= 0
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.start >= prev.end + 0.05
            assert cur.prompt_tokens > prev.prompt_tokens + prev.completion_tokens
            assert cur.cached_tokens > (prev.prompt_tokens // 64) * 64 - 64
            assert cur.ttft is not None and cur.ttft <= cur.end - cur.start
    summary = summarize_replay(result)
    assert [row["turn"] for row in summary["by_turn"]] == [0, 1, 2]
    assert summary["by_turn"][1]["cached_share"] > 0.5
    # the shared system prompt's blocks: later sessions' first turns hit them
    firsts = sorted((t[0] for t in by_session(result).values()), key=lambda r: r.start)
    assert firsts[-1].cached_tokens >= 256


async def test_a_closed_loop_of_one_user_runs_the_sessions_one_by_one(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """With --concurrency 1 the sessions have no start times: one user takes them in
    file order, each after the previous one's last turn."""
    with trio.fail_after(60):
        url, _ = await start(nursery)
        path = sessions_file(tmp_path, [None, None])
        config = ReplayConfig(url=url, model=GPT, sessions=path, concurrency=1)
        result = await run_replay(config, load_traffic(config))
    sessions = by_session(result)
    assert sessions[1][0].start >= sessions[0][-1].end


async def test_a_mooncake_trace_is_sent_at_its_times_and_shares_blocks(
    nursery: trio.Nursery,
) -> None:
    """--trace: each request leaves no earlier than its (sped-up) time; requests whose
    hash_ids start alike find each other's blocks cached."""
    with trio.fail_after(60):
        url, _ = await start(nursery)
        config = ReplayConfig(
            url=url,
            model=GPT,
            trace=WORKLOADS / "mooncake-sample.jsonl",
            endpoint="completions",
            speedup=20.0,
            window=(0.0, 6.0),
        )
        traffic = load_traffic(config)
        result = await run_replay(config, traffic)
    assert all(r.outcome == "ok" for r in result.records)
    times = {r.line: r.time for r in traffic.requests}  # type: ignore[union-attr]
    for r in result.records:
        assert r.start >= times[r.line] - 1e-3
    assert sum(1 for r in result.records if (r.cached_tokens or 0) >= 1024) >= 2


class _StampedTransport:
    """A memory transport whose reads the kernel stamped ``early`` seconds before they
    returned, and whose connections take ``connect_delay`` seconds to open."""

    def __init__(self, inner: Any, early: float) -> None:
        self.inner = inner
        self.early = early
        self.receipt: float | None = None

    async def send_all(self, data: bytes) -> None:
        await self.inner.send_all(data)

    async def receive_some(self, max_bytes: int) -> bytes:
        data: bytes = await self.inner.receive_some(max_bytes)
        self.receipt = trio.current_time() - self.early
        return data

    def is_readable(self) -> bool:
        return bool(self.inner.is_readable())

    def last_receipt(self) -> float | None:
        return self.receipt

    def close(self) -> None:
        self.inner.close()


async def test_a_turns_ttft_counts_from_its_send_to_its_bytes_arrival(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Rule 4: the TTFT runs from the request leaving for the socket to the kernel's
    receipt of the first token's bytes. Each turn here opens a new connection taking 1 s
    (the fake closes each after its answer) and each read is stamped 0.1 s before it
    returns; the fake's first token comes 0.25 s after the request: the TTFT is 0.15 s,
    though the turn took over 1.25 s. ``sent`` is the send: 1 s after the turn started where it opened a connection."""
    async with trio.open_nursery() as nursery:
        fake = MemoryFake(nursery, FakeConfig(token_delay=0.25, close_connections=True))

        async def connect(origin: Origin) -> Transport:
            await trio.sleep(1.0)
            return _StampedTransport(await fake.connect(origin), early=0.1)

        path = sessions_file(tmp_path, [0.0])
        config = ReplayConfig(
            url="http://127.0.0.1:9", model="m", sessions=path, endpoint="completions"
        )
        with trio.fail_after(100):
            result = await run_replay(config, load_traffic(config), connect=connect)
        nursery.cancel_scope.cancel()
    assert [r.outcome for r in result.records] == ["ok"] * 3
    for r in result.records:
        assert r.end - r.start > 1.25
        assert r.ttft == pytest.approx(0.15, abs=1e-9)
    # ``sent``: the first turn reuses the preflight's connection; the others connect first
    sends = [r.sent - r.start for r in result.records if r.sent is not None]
    assert sends == pytest.approx([0.0, 1.0, 1.0], abs=1e-9)


# -- the command line -----------------------------------------------------------------------


def test_replay_flags_that_do_not_go_together_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sessions_file(tmp_path, [0.0])
    base = ["load", "--url", "http://127.0.0.1:9", "--model", GPT]
    for extra, message in (
        (["--sessions", str(path), "--rate", "2"], "--rate does not go with --sessions"),
        (["--sessions", str(path), "--duration", "2"], "--duration does not go with"),
        (["--sessions", str(path), "--speedup", "2"], "--speedup and --trace-window apply"),
        (["--concurrency", "2", "--requests", "3", "--speedup", "2"], "--speedup needs --trace"),
    ):
        assert cli.main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err


def test_a_bad_session_file_exits_1_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"session": 0, "turns": [{"user_tokens": -2, "output_tokens": 1}]}\n')
    code = cli.main(
        ["load", "--url", "http://127.0.0.1:9", "--model", GPT, "--sessions", str(path)]
    )
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err == (
        f"inference-lab load: error: {path}:1: turns[0].user_tokens: "
        "must be an integer >= 1, got -2"
    )


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"timestamp": 0, "input_length": 2**63 - 1, "output_length": 4}],
            ":1: input_length: must be at most 10,000,000, got 9223372036854775807",
        ),
        (
            [
                {"timestamp": 0, "input_length": 5, "output_length": 4},
                {"timestamp": 1e308, "input_length": 5, "output_length": 4},
            ],
            ":2: timestamp: 1e+305 s after the trace's first request",
        ),
    ],
)
def test_a_trace_the_client_cannot_send_exits_1_in_one_line(
    rows: list[dict[str, float]], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``load --trace`` with a prompt of 2**63 - 1 tokens (which it would build) or a
    request 1e305 s away (which it would wait for) is one line before any connection."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code = cli.main(["load", "--url", "http://127.0.0.1:9", "--model", GPT, "--trace", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err
    assert err.startswith(f"inference-lab load: error: {path}{message}"), err


def test_closed_loop_sessions_need_concurrency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = sessions_file(tmp_path, [None])
    code = cli.main(
        ["load", "--url", "http://127.0.0.1:9", "--model", GPT, "--sessions", str(path)]
    )
    assert code == 1
    assert "give --concurrency N" in capsys.readouterr().err


async def test_the_cli_replays_and_writes_the_per_turn_summary(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The whole command in a worker thread against the real server: exit 0, the JSON
    summary holds one row per turn."""
    with trio.fail_after(60):
        url, _ = await start(nursery)
        path = sessions_file(tmp_path, [0.0, 0.01])
        out = tmp_path / "summary.json"
        argv = ["load", "--url", url, "--model", GPT, "--sessions", str(path), "-o", str(out)]
        code = await trio.to_thread.run_sync(cli.main, argv)
    assert code == 0
    summary = json.loads(out.read_text())
    assert summary["mode"] == "sessions" and len(summary["by_turn"]) == 3
    assert summary["outcomes"] == {"ok": 6}
