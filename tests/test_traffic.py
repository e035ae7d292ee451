"""Traffic shapes (``inference_lab/traffic``): block-hash chains, sessions, trace files and
rate schedules — pure code shared by the simulator and, later, the load client."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from inference_lab.errors import ConfigError
from inference_lab.traffic.hashing import (
    ROOT,
    SyntheticStream,
    block_hash,
    token_block_hashes,
    trace_block_hashes,
)
from inference_lab.traffic.schedules import PiecewiseRate, SineRate, SquareRate, arrival_times
from inference_lab.traffic.sessions import SessionPlan, Turn, read_sessions, shared_prefix
from inference_lab.traffic.traces import detect_format, read_trace
from inference_lab.validation import FieldError

ROOT_DIR = Path(__file__).resolve().parent.parent
SAMPLES = ROOT_DIR / "configs" / "workloads"


# ------------------------------------------------------------------ hashing


def test_token_hashes_chain_full_blocks_and_depend_on_the_whole_prefix() -> None:
    """Hash i covers tokens [0, (i + 1) * block_size): equal prefixes give equal hashes, a
    change in block 0 changes every later hash, and a partial block has none."""
    a = token_block_hashes(list(range(40)), 16)
    assert len(a) == 2
    assert a[0] == block_hash(ROOT, np.arange(16, dtype=np.int64).tobytes())
    assert a[1] == block_hash(a[0], np.arange(16, 32, dtype=np.int64).tobytes())
    b = token_block_hashes([*range(32), 99, 98], 16)
    assert b == a
    c = token_block_hashes([1000, *range(1, 40)], 16)
    assert c[0] != a[0] and c[1] != a[1]
    assert token_block_hashes(list(range(15)), 16) == ()


def test_hashes_are_stable_across_processes() -> None:
    """A chain does not depend on Python's per-process hash salt (BLAKE2b, Rule 1)."""
    assert token_block_hashes([1, 2, 3, 4], 2) == (
        block_hash(ROOT, bytes.fromhex("01000000000000000200000000000000")),
        block_hash(
            block_hash(ROOT, bytes.fromhex("01000000000000000200000000000000")),
            bytes.fromhex("03000000000000000400000000000000"),
        ),
    )
    assert block_hash(ROOT, b"x") == int.from_bytes(
        hashlib.blake2b(bytes(8) + b"x", digest_size=8).digest(), "little"
    )


def test_trace_hash_ids_map_to_engine_blocks_by_their_last_token() -> None:
    """Mooncake ids name 512-token prefixes: engine block i (64 tokens) takes the id of
    the trace block holding its last token, so two requests sharing ids [7, 8] share
    engine blocks 0..15 and differ from block 16 on when their third id differs."""
    a = trace_block_hashes([7, 8, 9], 1300, 64, 512)
    b = trace_block_hashes([7, 8, 10], 1300, 64, 512)
    assert len(a) == 1300 // 64
    assert a[:16] == b[:16]
    assert a[16] != b[16]
    # ids covering fewer tokens than the prompt: only the covered full blocks
    assert len(trace_block_hashes([7], 1300, 64, 512)) == 8


def test_synthetic_streams_share_exactly_the_shared_prefix_blocks() -> None:
    """Two sessions with a shared 100-token system prompt (16-token blocks) share its six
    whole blocks and nothing after; a stream's chain grows consistently."""
    system = shared_prefix(100, 16)
    assert system is not None
    s1 = SyntheticStream(1, 16, system, 100)
    s2 = SyntheticStream(2, 16, system, 100)
    h1, h2 = s1.hashes(400), s2.hashes(400)
    assert h1[:6] == h2[:6] == system.hashes(96)
    assert not set(h1[6:]) & set(h2[6:])
    assert s1.hashes(200) == h1[:12]
    assert s1.hashes(1000)[:25] == h1


def test_session_plan_prompts_resend_the_conversation() -> None:
    """Turn k's prompt = turn k-1's prompt + its answer + k's user tokens; turn k's chain
    covers its prompt and answer, so turn k + 1's prompt starts with all of it."""
    system = shared_prefix(64, 16)
    plan = SessionPlan(3, [Turn(10, 20), Turn(5, 7, 2.0), Turn(30, 1, 1.0)], 64, 16, system)
    assert [plan.prompt_tokens(k) for k in range(3)] == [74, 99, 136]
    for k in range(2):
        assert plan.hashes(k + 1)[: len(plan.hashes(k))] == plan.hashes(k)
    assert len(plan.hashes(0)) == (74 + 20) // 16
    assert system is not None and plan.hashes(0)[:4] == system.hashes(64)
    other = SessionPlan(4, [Turn(10, 20)], 64, 16, system)
    assert other.hashes(0)[:4] == plan.hashes(0)[:4]
    assert other.hashes(0)[4:] != plan.hashes(0)[4 : len(other.hashes(0))]
    own = SessionPlan(5, [Turn(10, 20)], 64, 16, None)
    assert own.hashes(0)[0] != plan.hashes(0)[0]
    assert SessionPlan(6, [Turn(10, 20)], 64, None).hashes(0) == ()


# ------------------------------------------------------------------ traces


@pytest.mark.parametrize(
    ("name", "fmt", "requests", "skipped"),
    [
        ("mooncake-sample.jsonl", "mooncake", 24, 0),
        ("azure-sample.csv", "azure", 24, 0),
        ("burstgpt-sample.csv", "burstgpt", 22, 2),
        ("openai-batch-sample.jsonl", "openai_batch", 10, 0),
    ],
)
def test_shipped_samples_are_read_and_their_format_detected(
    name: str, fmt: str, requests: int, skipped: int
) -> None:
    """Each shipped sample is told apart by its first line and read whole, in time order,
    the first request at 0; BurstGPT's failed rows (0 response tokens) are skipped."""
    path = SAMPLES / name
    assert detect_format(path) == fmt
    trace = read_trace(path, tokenize=lambda _url, body: [1] * 50)
    assert (trace.format, len(trace.requests), trace.skipped_failed) == (fmt, requests, skipped)
    times = [r.time for r in trace.requests]
    assert times == sorted(times) and times[0] == 0.0
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in trace.requests)


def test_mooncake_times_are_milliseconds_from_the_first_request(tmp_path: Path) -> None:
    """timestamp is ms; times count from the earliest row; hash_ids are kept."""
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 5000, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 2000, "input_length": 100, "output_length": 9, "hash_ids": [0]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    trace = read_trace(path)
    assert [(r.time, r.input_tokens, r.hash_ids, r.line) for r in trace.requests] == [
        (0.0, 100, (0,), 2),
        (3.0, 600, (0, 1), 1),
    ]


def test_azure_timestamps_with_seven_digits_and_offsets(tmp_path: Path) -> None:
    """Azure's TIMESTAMP has 100 ns digits (2023) or an offset (2024): both parse."""
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,10,2\n"
        "2023-11-16 18:15:48.1805901,20,0\n"
        "2023-11-16 18:15:49.9305900+00:00,30,4\n"
    )
    trace = read_trace(path)
    assert [(r.time, r.input_tokens) for r in trace.requests] == [
        (0.0, 10),
        (pytest.approx(3.25), 30),
    ]
    assert trace.skipped_failed == 1


def test_window_and_speedup(tmp_path: Path) -> None:
    """The window keeps trace seconds [start, end), shifts start to 0, then divides by the
    speedup."""
    path = tmp_path / "b.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        + "".join(f"{t},ChatGPT,10,5,15,API log\n" for t in (100, 110, 130, 160, 200))
    )
    trace = read_trace(path, speedup=2.0, start=10.0, end=60.0)  # trace times 0..100
    assert [r.time for r in trace.requests] == [0.0, 10.0]  # 10 and 30, less 10, halved
    assert trace.outside_window == 3


@pytest.mark.parametrize(
    ("fmt", "text", "message"),
    [
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
            '{"timestamp": 1, "input_length": -3, "output_length": 1}\n',
            "t:2: input_length: must be an integer >= 1, got -3",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": "5", "output_length": 1}\n',
            "t:1: input_length: must be an integer >= 1, got '5'",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 5}\n',
            "t:1: output_length: missing",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1, "x"]}\n',
            "t:1: hash_ids: must be a list of integers, got [1, 'x']",
        ),
        ("mooncake", '{"timestamp": 0,\n', "t:1: invalid JSON"),
        (
            "azure",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,2\nyesterday,1,1\n",
            "t:3: TIMESTAMP: must be a date and time, got 'yesterday'",
        ),
        (
            "azure",
            "TIMESTAMP,Context,GeneratedTokens\n",
            "t:1: header: missing column(s) ContextTokens",
        ),
        (
            "burstgpt",
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,ten,18,490,Conversation log\n",
            "t:2: Request tokens: must be an integer >= 0, got 'ten'",
        ),
        (
            "openai_batch",
            '{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\n',
            "t:1: url: must be one of /v1/chat/completions, /v1/completions; got '/v1/embeddings'",
        ),
        (
            "openai_batch",
            '{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}\n',
            "t:1: body.max_tokens: missing",
        ),
        (
            "openai_batch",
            '{"url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 0}}\n',
            "t:1: body.max_tokens: must be an integer >= 1, got 0",
        ),
    ],
)
def test_a_bad_row_is_one_line_naming_file_line_and_field(
    tmp_path: Path, fmt: str, text: str, message: str
) -> None:
    """Rule 1 of traces: the error is one line, ``file:line: field: message``."""
    path = tmp_path / "t"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_trace(path, fmt, tokenize=lambda _url, _body: [1, 2])
    assert str(info.value).startswith(str(tmp_path / message)), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("fmt", "text", "message"),
    [
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [9223372036854775808]}\n',
            "t:1: hash_ids: must be 64-bit integers (-2**63..2**63-1), got 9223372036854775808",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 9223372036854775807, "output_length": 1}\n',
            "t:1: input_length: must be at most 10,000,000, got 9223372036854775807",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
            '{"timestamp": 1e308, "input_length": 5, "output_length": 1}\n',
            "t:2: timestamp: 1e+305 s after the trace's first request; a trace may span at most "
            "31,622,400 s (366 days)",
        ),
        (
            "burstgpt",
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,10,99999999999,490,Conversation log\n",
            "t:2: Response tokens: must be at most 10,000,000, got 99999999999",
        ),
        (
            "openai_batch",
            '{"url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 4, "n": 1000}}\n',
            "t:1: body.n: must be at most 128, got 1000",
        ),
        ("mooncake", "[" * 100_000 + "]" * 100_000 + "\n", "t:1: invalid JSON: nested too deep"),
    ],
)
def test_numbers_a_consumer_cannot_hold_are_one_line_errors(
    tmp_path: Path, fmt: str, text: str, message: str
) -> None:
    """Rule 4 of traces: a hash id past 64 bits (a traceback in ``sim``), a prompt of 2**63
    tokens (a load client building it), a time 1e305 s away (a replay waiting for it),
    JSON nested 100,000 deep: each is one line naming the bound."""
    path = tmp_path / "t"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_trace(path, fmt, tokenize=lambda _url, _body: [1, 2])
    assert str(info.value) == str(tmp_path / message)


def test_a_replay_that_would_last_past_the_bound_is_refused(tmp_path: Path) -> None:
    """A day-long trace at speedup 1e-6 would be replayed over 2,700 years: refused, naming
    the speedup; at speedup 1 it is read."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
        '{"timestamp": 86400000, "input_length": 5, "output_length": 1}\n'
    )
    assert len(read_trace(path).requests) == 2
    with pytest.raises(ConfigError, match=r"t.jsonl:2: at speedup 1e-06 this request comes"):
        read_trace(path, speedup=1e-6)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            '{"session": 9223372036854775808, "turns": [{"user_tokens": 1, "output_tokens": 1}]}',
            "session: must be at most 9,223,372,036,854,775,807",
        ),
        (
            '{"session": 0, "start": 1e300, "turns": [{"user_tokens": 1, "output_tokens": 1}]}',
            "start: must be at most 31,622,400 s (366 days), got 1e+300",
        ),
        (
            '{"session": 0, "turns": [{"user_tokens": 6000000, "output_tokens": 1}, '
            '{"user_tokens": 6000000, "output_tokens": 1}]}',
            "turns: the conversation holds 12,000,002 tokens, more than 10,000,000",
        ),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deep"),
    ],
)
def test_a_session_file_is_bounded_as_a_trace_is(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(ConfigError) as info:
        read_sessions(path)
    assert str(info.value).startswith(f"{path}:1: {message}"), str(info.value)


def test_an_unknown_format_and_a_missing_file_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match="cannot tell the trace format"):
        detect_format(tmp_path / "x.txt")
    with pytest.raises(ConfigError, match="no such file"):
        read_trace(tmp_path / "missing.jsonl")


def test_batch_default_max_tokens_and_tokenizer_errors(tmp_path: Path) -> None:
    """A body without max_tokens takes the default; a tokenizer's ValueError is a body
    error on that line."""
    path = tmp_path / "b.jsonl"
    path.write_text('{"url": "/v1/completions", "body": {"prompt": "hello"}}\n')
    trace = read_trace(path, default_max_tokens=7, tokenize=lambda _u, _b: [5, 6, 7])
    (r,) = trace.requests
    assert (r.input_tokens, r.output_tokens, r.tokens) == (3, 7, (5, 6, 7))

    def bad(_url: str, _body: object) -> list[int]:
        raise ValueError("prompt: must be a string")

    with pytest.raises(ConfigError, match=r"b.jsonl:1: body: prompt: must be a string"):
        read_trace(path, default_max_tokens=7, tokenize=bad)


# ------------------------------------------------------------------ rate schedules


def _unit(n: int) -> np.ndarray[object, np.dtype[np.float64]]:
    return np.arange(n, dtype=np.float64)


def test_piecewise_step_schedule_by_hand() -> None:
    """Rate 2/s for 10 s then 0.5/s: arrival k (unit time k) is at k / 2 up to 20, then
    10 + (k - 20) / 0.5."""
    sch = PiecewiseRate(points=((0.0, 2.0), (10.0, 0.5)))
    t = arrival_times(sch, _unit(25))
    assert t[:21] == pytest.approx([k / 2 for k in range(21)], abs=1e-9)
    assert t[21:] == pytest.approx([10 + (k - 20) / 0.5 for k in range(21, 25)], abs=1e-9)


def test_piecewise_linear_schedule_and_a_rate_that_ends() -> None:
    """Rate linear from 0 to 4/s over [0, 2], down to 0 at 3, then 0 for ever:
    Λ(t) = t² up to 2, 4 + 4x - 2x² with x = t - 2 up to 3, Λ(∞) = 6; a unit time past 6
    never arrives (inf)."""
    sch = PiecewiseRate(points=((0.0, 0.0), (2.0, 4.0), (3.0, 0.0)), interpolation="linear")
    assert sch.cumulative(np.array([1.0, 2.0, 3.0, 9.0])) == pytest.approx([1.0, 4.0, 6.0, 6.0])
    assert sch.total() == pytest.approx(6.0)
    t = arrival_times(sch, np.array([1.0, 2.25, 5.0, 7.0]))
    x = (4 - math.sqrt(8)) / 4  # 4 + 4x - 2x² = 5
    assert t[:3] == pytest.approx([1.0, 1.5, 2 + x], abs=1e-9)
    assert math.isinf(t[3])


def test_sine_and_square_cumulative_rates() -> None:
    """Sine: over a whole period the count is mean * period; square: high * duty * period
    + low * rest per period."""
    sine = SineRate(mean=10.0, amplitude=5.0, period_secs=60.0)
    assert sine.cumulative(np.array([60.0, 120.0])) == pytest.approx([600.0, 1200.0])
    assert sine.cumulative(np.array([15.0]))[0] > 150.0  # the first quarter is above mean
    sq = SquareRate(low=1.0, high=9.0, period_secs=10.0, duty=0.2)
    assert sq.cumulative(np.array([2.0, 10.0, 13.0])) == pytest.approx([18.0, 26.0, 45.0])
    t = arrival_times(sq, np.array([9.0, 18.0, 19.0]))
    assert t == pytest.approx([1.0, 2.0, 3.0], abs=1e-9)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: PiecewiseRate(points=()), "points"),
        (lambda: PiecewiseRate(points=((1.0, 2.0),)), "points"),
        (lambda: PiecewiseRate(points=((0.0, 2.0), (0.0, 1.0))), "points"),
        (lambda: PiecewiseRate(points=((0.0, -1.0),)), "points"),
        (lambda: PiecewiseRate(points=((0.0, 0.0),)), "points"),
        (lambda: PiecewiseRate(points=((0.0, 1.0),), interpolation="cubic"), "interpolation"),
        (lambda: SineRate(mean=1.0, amplitude=2.0, period_secs=1.0), "amplitude"),
        (lambda: SquareRate(low=0.0, high=1.0, period_secs=1.0, duty=1.0), "duty"),
    ],
)
def test_schedule_rules(make: object, field: str) -> None:
    with pytest.raises(FieldError) as info:
        make()  # type: ignore[operator]
    assert info.value.field == field
