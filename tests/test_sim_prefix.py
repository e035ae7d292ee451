"""``inference-lab sim`` with prefix caching: session workloads, trace replay, routers
across replicas, and the outputs' prefix-cache, session and replica sections
(``docs/prefix-caching.md``, ``docs/sim.md``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import attrs
import pytest

from inference_lab import cli
from inference_lab.core.config import Deployment, load_deployment, load_workload
from inference_lab.sim.run import run_simulation
from inference_lab.sim.text import format_summary
from inference_lab.traffic.traces import read_trace

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
WORKLOADS = CONFIGS / "workloads"
GPT_OSS = str(CONFIGS / "gpt-oss-20b.toml")
LLAMA = str(CONFIGS / "Llama-3.1-8B-Instruct.toml")

SESSIONS = """
arrival_pattern = "poisson"
arrival_rate = 4.0
input_len_dist = { type = "fixed", value = 100 }
output_len_dist = { type = "fixed", value = 50 }
seed = 3

[sessions]
num_sessions = 12
turns = { type = "fixed", value = 4 }
think_time = { type = "fixed", value = 1.0 }
system_prompt_tokens = 1024
"""


def run_cli(*argv: str) -> int:
    return cli.main(["sim", *argv])


def caching(dep: Deployment, on: bool) -> Deployment:
    return attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, enable_prefix_caching=on))


def test_a_session_workload_hits_and_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Twelve 4-turn sessions with a shared 1,024-token system prompt: every turn after a
    session's first finds its conversation so far cached, the text summary has the prefix
    cache and session lines, the JSON their sections, the CSV the session, turn, cached
    tokens and replica of every request."""
    wl = tmp_path / "s.toml"
    wl.write_text(SESSIONS)
    out, rows_path = tmp_path / "r.json", tmp_path / "r.csv"
    argv = ["--config", LLAMA, "--hardware", "h100", "--workload", str(wl), "-q"]
    assert run_cli(*argv, "-o", str(out), "--request-csv", str(rows_path)) == 0
    text = capsys.readouterr().out
    assert "prefix cache on: " in text
    assert "sessions     12 sessions, 48 turns; TTFT p50 by turn (ms)" in text
    doc = json.loads(out.read_text())
    pc = doc["prefix_cache"]
    assert pc["enabled"] is True and pc["requests"] == 48
    assert pc["hit_tokens"] == pc["prefill_tokens_saved"] > 0
    assert pc["hit_rate"] == pytest.approx(pc["hit_tokens"] / pc["query_tokens"])
    assert [t["turn"] for t in doc["sessions"]["by_turn"]] == [0, 1, 2, 3]
    assert doc["config"]["workload"]["sessions"]["num_sessions"] == 12
    with rows_path.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 48
    for r in rows:
        turn = int(r["turn"])
        prompt = int(r["prompt_tokens"])
        assert prompt == 1024 + 100 + turn * 150
        cached = int(r["cached_tokens"])
        # turn k > 0 resends the previous prompt and answer: at least those full blocks
        # (16 tokens) are cached; a first turn finds the system prompt once one session
        # has computed it
        if turn:
            assert cached >= (prompt - 100) // 16 * 16
        assert cached <= prompt - 1 and cached % 16 == 0
        assert r["replica"] == "0"
    assert {r["session"] for r in rows} == {str(i) for i in range(12)}


def test_caching_off_computes_every_prompt_and_says_so() -> None:
    """The same sessions with enable_prefix_caching = false: no hits, every prompt
    position computed, a larger TTFT; the summary says the cache is off."""
    dep = load_deployment(LLAMA, "h100")
    wl = load_workload(WORKLOADS / "chat-sessions-200.toml")
    assert wl.sessions is not None
    wl = attrs.evolve(wl, sessions=attrs.evolve(wl.sessions, num_sessions=20))
    on = run_simulation(caching(dep, True), wl)
    off = run_simulation(caching(dep, False), wl)
    assert on.prefix_cache is not None and off.prefix_cache is not None
    assert on.prefix_cache.hit_tokens > 0
    assert off.prefix_cache.hit_tokens == off.prefix_cache.query_tokens == 0
    assert all(f.cached_tokens == 0 for f in off.finished)
    assert off.summary.ttft.mean is not None and on.summary.ttft.mean is not None
    assert off.summary.ttft.mean > on.summary.ttft.mean
    assert "prefix cache off (enable_prefix_caching = false)" in format_summary(off)
    assert on.summary.input_tokens == off.summary.input_tokens


def test_routers_spread_sessions_and_report_per_replica() -> None:
    """Four replicas: every router runs all requests; the summary has one request count
    (and hit rate) per replica; prefix_affinity and kv_aware find more of the prompts
    cached than round_robin, which scatters each session's turns."""
    dep = load_deployment(LLAMA, "h100")
    wl = load_workload(WORKLOADS / "chat-sessions-200.toml")
    assert wl.sessions is not None
    wl = attrs.evolve(wl, sessions=attrs.evolve(wl.sessions, num_sessions=24))
    hit = {}
    for router in ("round_robin", "prefix_affinity", "kv_aware"):
        d = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, replicas=4, router=router))
        result = run_simulation(d, wl)
        assert len(result.replicas) == 4
        assert sum(r.requests for r in result.replicas) == len(result.finished) == 24 * 8
        assert "replicas     4: requests " in format_summary(result)
        assert result.prefix_cache is not None
        hit[router] = result.prefix_cache.hit_rate
    assert hit["prefix_affinity"] > hit["round_robin"]
    assert hit["kv_aware"] > hit["round_robin"]


@pytest.mark.parametrize(
    ("name", "hits"),
    [
        ("mooncake-sample.jsonl", True),
        ("azure-sample.csv", False),
        ("burstgpt-sample.csv", False),
        ("openai-batch-sample.jsonl", None),
    ],
)
def test_every_sample_trace_replays(
    name: str, hits: bool | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each shipped sample replays through ``sim --trace``; the Mooncake sample's shared
    hash_ids hit; the CSV traces carry no content (no prefix-cache line)."""
    out = tmp_path / "r.json"
    rc = run_cli(
        "--config",
        LLAMA,
        "--hardware",
        "h100",
        "--trace",
        str(WORKLOADS / name),
        "-q",
        "-o",
        str(out),
    )
    assert rc == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["requests"]["refused"] == 0
    assert doc["config"]["workload"]["trace"].endswith(name)
    if hits is None:
        assert "prefix cache on" in text
    elif hits:
        assert doc["prefix_cache"]["hit_tokens"] > 0
    else:
        assert "prefix cache" not in text


def test_a_batch_file_whose_requests_arrive_apart_hits_on_shared_history(tmp_path: Path) -> None:
    """The OpenAI batch sample's conversations resend their history; replayed one request
    at a time (each after the last finished) its later turns find their history cached:
    tokens from the byte rule's ids, hashed at the deployment's block size."""
    from inference_lab.api.tokenizer import ByteTokenizer
    from inference_lab.sim.batch_files import batch_tokenizer

    trace = read_trace(
        WORKLOADS / "openai-batch-sample.jsonl", tokenize=batch_tokenizer(ByteTokenizer())
    )
    spaced = attrs.evolve(
        trace, requests=tuple(attrs.evolve(r, time=10.0 * i) for i, r in enumerate(trace.requests))
    )
    result = run_simulation(load_deployment(LLAMA, "h100"), spaced)
    cached = {f.request_id: f.cached_tokens for f in result.finished}
    assert result.prefix_cache is not None
    assert sum(1 for c in cached.values() if c > 0) >= 6
    assert result.prefix_cache.hit_tokens > 0


@pytest.mark.parametrize("flag", ["--trace-window", "--window"])
def test_window_and_speedup_flags(flag: str, tmp_path: Path) -> None:
    """--trace-window 2:10 --speedup 2 replays the Mooncake sample's requests from 2 s to
    10 s, twice as fast; --window is the same flag's older spelling (``load`` spells it
    --trace-window: its --window is the AIMD window)."""
    out = tmp_path / "r.json"
    argv = ["--config", LLAMA, "--hardware", "h100", "-q", "-o", str(out)]
    trace = WORKLOADS / "mooncake-sample.jsonl"
    assert run_cli(*argv, "--trace", str(trace), flag, "2:10", "--speedup", "2") == 0
    doc = json.loads(out.read_text())
    expected = read_trace(trace, start=2.0, end=10.0, speedup=2.0)
    assert doc["requests"]["submitted"] == len(expected.requests)
    assert doc["config"]["workload"]["speedup"] == 2.0
    assert doc["config"]["workload"]["window_start_s"] == 2.0


@pytest.mark.parametrize(
    ("argv", "code", "fragment"),
    [
        (["--trace", "t.jsonl", "--workload", "w.toml"], 2, "not allowed with argument"),
        (["--workload", "w.toml", "--speedup", "2"], 2, "--speedup applies to --trace only"),
        (["--trace", "t.jsonl", "--speedup", "0"], 2, "argument --speedup: must be a number > 0"),
        (
            ["--trace", "t.jsonl", "--trace-window", "5:2"],
            2,
            "argument --trace-window/--window: must be START:END",
        ),
        (["--trace", "missing.jsonl"], 1, "missing.jsonl: no such file"),
        (["--trace", "t.jsonl", "--seed", "3"], 2, "--seed applies to --workload only"),
    ],
)
def test_bad_trace_flags_are_one_line(
    argv: list[str], code: int, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = run_cli("--config", LLAMA, "--hardware", "h100", *argv)
    err = capsys.readouterr().err
    assert rc == code
    assert len(err.splitlines()) == 1 and fragment in err, err


def test_a_bad_trace_row_is_one_line_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n{"timestamp": 1}\n')
    rc = run_cli("--config", LLAMA, "--hardware", "h100", "--trace", str(bad), "-q")
    err = capsys.readouterr().err
    assert rc == 1
    assert err.strip() == f"inference-lab sim: error: {bad}:2: input_length: missing"


def test_without_hashes_the_summary_has_no_new_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """A workload without sessions or content on one replica prints exactly the lines it
    always printed: no prefix-cache, session or replica line."""
    assert (
        run_cli(
            "--config",
            GPT_OSS,
            "--hardware",
            "b200",
            "--workload",
            str(WORKLOADS / "quick.toml"),
            "-q",
        )
        == 0
    )
    text = capsys.readouterr().out
    heads = [line.split()[0] for line in text.splitlines() if line.strip()]
    assert heads[-5:] == ["requests", "throughput", "utilisation", "preemptions", "time"]
    assert "prefix cache" not in text and "sessions" not in text and "replicas" not in text


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [2**63, 5]},
            "hash_ids: must be 64-bit integers",
        ),
        (
            {"timestamp": 0, "input_length": 2**63 - 1, "output_length": 4},
            "input_length: must be at most 10,000,000",
        ),
    ],
)
def test_a_trace_number_past_its_bound_is_one_line(
    row: dict[str, int | list[int]],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``sim --trace`` with a Mooncake hash id >= 2**63 printed a ``struct.error``
    traceback; now it, and a prompt of 2**63 - 1 tokens, are one line and exit 1."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert run_cli("--config", GPT_OSS, "--hardware", "b200", "--trace", str(path), "-q") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"inference-lab sim: error: {path}:1: {message}") and "\n" not in err
