"""``benchkit``, what the scripts share: the server subprocess, the control
endpoint accessors, the closed-loop prediction, the steal time and the JSON helpers."""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import benchkit
import pytest
import trio
from benchkit import (
    Result,
    ServerProcess,
    blocking_stream,
    columns,
    completion_request,
    get_capacity,
    get_stats,
    machine_steal,
    model_entry,
    one_stream,
    parse_steal,
    post_capacity,
    predict_closed_loop,
    request_json,
    rounded,
    steal_pct,
)

from inference_lab.core.config import load_deployment
from inference_lab.resources import shipped_dir

GPT_OSS = shipped_dir("configs") / "gpt-oss-20b.toml"
MODEL = "gpt-oss-20b"


def test_server_process_serves_and_stops(tmp_path: Path) -> None:
    """``ServerProcess`` starts ``inference-lab serve`` on 127.0.0.1 from any directory,
    is healthy on entry, speaks the control endpoints, and stops the server gracefully on
    exit (exit code 0); stopping again does nothing."""
    log = tmp_path / "server.log"
    args = ["--config", str(GPT_OSS), "--max-num-seqs", "16"]
    with ServerProcess(args, log=log, cwd=tmp_path) as server:
        assert server.url.startswith("http://127.0.0.1:")

        async def talk() -> None:
            with trio.fail_after(30):
                assert model_entry(await get_capacity(server.url), MODEL)["max_num_seqs"] == 16
                changed = await post_capacity(server.url, model=MODEL, max_waiting=5)
                assert model_entry(changed, MODEL)["max_waiting"] == 5
                stats = await get_stats(server.url)
                assert model_entry(stats, MODEL)["max_waiting"] == 5
                status, body = await request_json(server.url, "GET", "/v1/models")
                assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]
                status, _ = await request_json(server.url, "GET", "/no/such/path")
                assert status == 404
                with pytest.raises(RuntimeError, match="HTTP 4"):
                    await post_capacity(server.url, model=MODEL, max_num_seqs=0)

        trio.run(talk)
        proc = server.proc
    assert proc is not None and proc.returncode == 0
    assert "SIGINT" in log.read_text()
    server.stop()
    assert proc.returncode == 0


def test_server_process_reports_a_server_that_cannot_start(tmp_path: Path) -> None:
    """A server that exits at startup is a RuntimeError carrying what it printed, and
    nothing is left running."""
    with pytest.raises(RuntimeError, match="did not start"):
        ServerProcess(["--config", str(tmp_path / "missing.toml")]).__enter__()


def test_model_entry_reads_both_control_answers() -> None:
    """``/control/capacity`` is a list of entries, ``/control/stats`` has them under
    ``models``; an unserved model is a KeyError naming it."""
    capacity = [{"model": "a", "x": 1}, {"model": "b", "x": 2}]
    assert model_entry(capacity, "b") == {"model": "b", "x": 2}
    assert model_entry({"process": {}, "models": capacity}, "a")["x"] == 1
    with pytest.raises(KeyError, match="'c'"):
        model_entry(capacity, "c")


def test_closed_loop_prediction_follows_littles_law() -> None:
    """Below the batch cap every client runs (E2E = L steps); above it the queue grows in
    proportion (E2E x C/S) while throughput stays B / t_step; TTFT is E2E less the decode
    steps, and a step with prefills costs more than a pure decode step."""
    dep = load_deployment(GPT_OSS, "b200")
    under = predict_closed_loop(dep, clients=8, seqs=16, prompt=100, output=50)
    over = predict_closed_loop(dep, clients=32, seqs=16, prompt=100, output=50)
    assert under["batch"] == 8 and over["batch"] == 16
    assert under["t_step_with_prefill"] > under["t_decode"] > 0
    assert under["t_decode"] < under["t_step"] < under["t_step_with_prefill"]
    assert under["e2e"] == pytest.approx(50 * under["t_step"])
    assert over["e2e"] == pytest.approx(2 * 50 * over["t_step"])
    for p in (under, over):
        assert p["output_tokens_per_s"] == pytest.approx(p["batch"] / p["t_step"])
        assert p["ttft"] == pytest.approx(p["e2e"] - 49 * p["t_step"])
        assert p["tpot"] == p["t_step"]


def test_json_helpers() -> None:
    """``columns`` transposes rows; ``rounded`` cuts floats to significant digits, deep."""
    rows = [{"t": 0.0, "n": 1}, {"t": 0.5, "n": 2}]
    assert columns(rows, ("t", "n")) == {"t": [0.0, 0.5], "n": [1, 2]}
    assert rounded({"a": [math.pi, (2.0 / 3.0, 7)]}, 3) == {"a": [3.14, [0.667, 7]]}


def test_the_raw_stream_clients_read_a_stream_and_a_refusal_to_their_end(tmp_path: Path) -> None:
    """``blocking_stream`` (a plain socket) and ``one_stream`` (trio) read a streamed
    completion to its chunked terminator, counting its tokens and timing its first one,
    and a refusal (a ``content-length`` answer) to the end of its body: neither waits for
    a connection the server keeps open."""
    args = ["--config", str(GPT_OSS)]
    with ServerProcess(args, log=tmp_path / "server.log", cwd=tmp_path) as server:
        host, port = server.url.removeprefix("http://").split(":")
        results = []
        for model in (MODEL, "no-such-model"):
            request = completion_request(host, model, 12)
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                results.append(blocking_stream(sock, request))
                results.append(blocking_stream(sock, request))  # the same connection again

            async def with_trio(request: bytes = request) -> Result:
                stream = await trio.open_tcp_stream(host, int(port))
                async with stream:
                    with trio.fail_after(30):
                        return await one_stream(stream, request, time.perf_counter())

            results.append(trio.run(with_trio))
    for result in results[:3]:
        assert (result.status, result.tokens) == (200, 12)
        assert 0 < result.ttft <= result.e2e
        assert sum(count for _, count in result.writes) == 13  # 12 tokens + the finish frame
    for result in results[3:]:
        assert (result.status, result.tokens, result.ttft, result.writes) == (404, 0, 0.0, [])


def test_the_hypervisors_share_of_the_machine_is_read_from_proc_stat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``steal`` is the cpu line's 8th number, the total the sum of the first eight; the
    share between two readings is in per cent, NaN when either is unknown."""
    text = "cpu  100 2 50 800 10 0 3 35 7 0\ncpu0 50 1 25 400 5 0 1 20 3 0\nintr 1\n"
    assert parse_steal(text) == (35, 1000)
    assert parse_steal("cpu  1 2 3 4\n") is None  # no steal column (an old kernel)
    assert parse_steal("cpu  1 2 3 x 5 6 7 8\n") is None
    assert parse_steal("intr 1\n") is None
    assert steal_pct((35, 1000), (85, 2000)) == 5.0
    assert math.isnan(steal_pct(None, (85, 2000)))
    assert math.isnan(steal_pct((35, 1000), (35, 1000)))  # no time passed
    stat = tmp_path / "stat"
    stat.write_text(text)
    monkeypatch.setattr(benchkit, "PROC_STAT", stat)
    assert machine_steal() == (35, 1000)
    monkeypatch.setattr(benchkit, "PROC_STAT", tmp_path / "missing")
    assert machine_steal() is None


def test_paired_differences_are_counted_in_decode_steps() -> None:
    """bench_pd_serve's ``step_bands``: differences a decode step apart fall in the bands
    around their median (here 0.003 s: six of ten), a step below, a step above, farther."""
    from bench_pd_serve import step_bands

    step = 0.015
    diffs = [0.003] * 6 + [0.003 - step] * 2 + [0.003 + step] + [0.003 + 3 * step]
    assert step_bands(diffs, step) == pytest.approx((0.6, 0.2, 0.1, 0.1))
    assert step_bands([], step) == (0.0, 0.0, 0.0, 0.0)


def test_only_the_warm_up_arrivals_are_moved() -> None:
    """bench_pd_serve's ``shifted_arrivals``: the first ``warm`` arrivals later by the
    shift, the measured ones as they were."""
    from bench_pd_serve import shifted_arrivals

    assert shifted_arrivals([0.0, 0.0, 1.0, 2.0], 2, 0.005) == [0.005, 0.005, 1.0, 2.0]
