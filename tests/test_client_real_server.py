"""The load client against the real server: ``create_app`` served by hypercorn's trio worker
on ``127.0.0.1:0`` in this process (``serve_cli.serve_app`` on ``serve_cli.bind_socket``).

What the client reports must agree with what the server did and with what the roofline
says it should have taken: its outcome counts match the server's admission counters, a lone
request's TTFT and E2E match the engine's own timeline for it, and the AIMD client's 529s
start where ``spec/saturation.md`` puts them, ``max_num_seqs + max_waiting + 1`` in flight,
also after the cap is changed live.

Real sockets mean the real clock: every test runs under ``trio.fail_after`` and the server
lives in pytest-trio's ``nursery`` fixture, cancelled when the test ends.
"""

from __future__ import annotations

import json
import time
from typing import Any

import attrs
import trio

from inference_lab.client.aimd import AIMDController
from inference_lab.client.http import ConnectionPool, parse_base_url
from inference_lab.client.load import LoadConfig, LoadResult, RequestRecord, run_load
from inference_lab.config import Deployment, load_deployment
from inference_lab.engine import Engine, RequestSpec
from inference_lab.serve import ServeSettings, ServeState, create_app, get_state
from inference_lab.serve_cli import bind_socket, serve_app
from tests.configs_util import GPT_OSS_20B

MODEL = "gpt-oss-20b"


@attrs.frozen
class Server:
    url: str
    deployment: Deployment
    state: ServeState


async def start_server(nursery: trio.Nursery, **scheduler: Any) -> Server:
    """gpt-oss-20b on b200 with ``[scheduler]`` overrides, served on a fresh port."""
    dep = load_deployment(GPT_OSS_20B, "b200")
    dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, **scheduler))
    app = create_app(ServeSettings(deployments=(dep,)))
    urls: list[str] = await nursery.start(serve_app, app, bind_socket("127.0.0.1", 0))
    return Server(url=urls[0], deployment=dep, state=get_state(app))


async def request_json(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One exchange over the client's own HTTP/1.1 connection."""
    origin = parse_base_url(url)
    pool = ConnectionPool(origin)
    conn = await pool.acquire()
    try:
        data = b"" if body is None else json.dumps(body).encode()
        headers = [("host", origin.authority), ("content-type", "application/json")]
        await conn.send_request(method, path, headers, data)
        response = await conn.receive_response()
        raw = await conn.read_body(1 << 20)
    finally:
        conn.close()
    return response.status_code, json.loads(raw)


def cut_peaks(result: LoadResult, lo: float = 0.0, hi: float = float("inf")) -> list[int]:
    """The limit just before each AIMD cut made in ``[lo, hi)`` (run time)."""
    changes = result.limit_changes
    return [
        prev
        for (_, prev), (t, new) in zip(changes, changes[1:], strict=False)
        if new < prev and lo <= t < hi
    ]


# ---------------------------------------------------------------------------------------


async def test_outcome_counts_match_the_servers_admissions(nursery: trio.Nursery) -> None:
    """Against ``max_num_seqs 4, max_waiting 4`` and 40 closed-loop workers, every request
    the client counts as ``ok`` is one the server admitted and finished, and every 529 it
    counts is one the server refused: no request is lost, double-counted or misclassified,
    and afterwards the server holds nothing."""
    with trio.fail_after(15):
        server = await start_server(nursery, max_num_seqs=4, max_waiting=4)
        config = LoadConfig(
            url=server.url, model=MODEL, concurrency=40, requests=80, max_tokens=100
        )
        result = await run_load(config)
        outcomes: dict[str, int] = {}
        for r in result.records:
            outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        refused = [r for r in result.records if r.outcome == "overloaded"]
        assert set(outcomes) == {"ok", "overloaded"}, outcomes
        assert len(result.records) == 80
        # 40 in flight against room for 8: both outcomes occur.
        assert outcomes["ok"] >= 4 and outcomes["overloaded"] >= 1, outcomes
        for r in refused:
            assert (r.status, r.error_type, r.error_code) == (
                529,
                "overloaded_error",
                "queue_saturated",
            )
        ok = [r for r in result.records if r.outcome == "ok"]
        assert all(r.completion_tokens == 100 and len(r.token_times) == 100 for r in ok)

        runtime = server.state.runtimes[MODEL]
        snap = runtime.snapshot()
        assert (snap.admitted, snap.refused) == (outcomes["ok"], outcomes["overloaded"])
        assert runtime.statistics().engine.finished == outcomes["ok"]
        status, capacity = await request_json(server.url, "GET", "/control/capacity")
        assert status == 200
        assert capacity == [
            {"model": MODEL, "max_waiting": 4, "max_num_seqs": 4, "waiting": 0, "running": 0}
        ]


def engine_timeline(dep: Deployment, prompt: int, max_tokens: int) -> tuple[float, float]:
    """(TTFT, E2E) of one request alone in a fresh engine: the server's roofline."""
    engine = Engine(dep)
    engine.submit(RequestSpec(prompt_tokens=prompt, max_tokens=max_tokens))
    while True:
        events = engine.step()
        if events.finished:
            done = events.finished[0]
            return (
                done.first_token_time - done.arrival_time,
                done.finish_time - done.arrival_time,
            )


async def test_lone_request_latency_matches_the_engine(nursery: trio.Nursery) -> None:
    """A request alone on the server streams its first token one prefill step after it
    arrives and its last one after the decode steps the engine prices: the client's TTFT,
    E2E and first-to-last-token span agree with ``Engine`` on the same deployment within a
    few ms (the HTTP round trip on loopback, which only ever adds)."""
    with trio.fail_after(15):
        server = await start_server(nursery)
        config = LoadConfig(url=server.url, model=MODEL, concurrency=1, requests=12, max_tokens=100)
        result = await run_load(config)
        records: list[RequestRecord] = list(result.records)
        assert [r.outcome for r in records] == ["ok"] * 12
        prompt = records[0].prompt_tokens
        assert prompt is not None
        ttft_pred, e2e_pred = engine_timeline(server.deployment, prompt, 100)
        assert 0.001 < ttft_pred < e2e_pred  # a real prefill step, then 99 decode steps

        # The engine never runs ahead of wall-clock, so no request is early; a busy CPU can
        # only make one late. The least delayed of twelve is the one to compare.
        ttfts = [r.ttft for r in records if r.ttft is not None]
        e2es = [r.e2e for r in records]
        assert min(ttfts) >= ttft_pred - 0.0005, (ttfts, ttft_pred)
        assert min(e2es) >= e2e_pred - 0.0005, (e2es, e2e_pred)
        # Loopback HTTP and the client add a few ms at most.
        assert min(ttfts) <= ttft_pred + 0.005, (ttfts, ttft_pred)
        assert min(e2es) <= e2e_pred + 0.006, (e2es, e2e_pred)
        # First to last token: both ends on the client's clock, so the round trip cancels
        # and the 99 decode steps remain (a mispriced step would be off by far more).
        span_pred = e2e_pred - ttft_pred
        spans = [r.token_times[-1] - r.token_times[0] for r in records]
        assert min(abs(span - span_pred) for span in spans) <= 0.002, (spans, span_pred)


async def test_aimd_first_529_at_seqs_plus_waiting_plus_one(nursery: trio.Nursery) -> None:
    """The AIMD client against ``max_num_seqs S = 8, max_waiting W = 12``: its first 529
    comes when its limit reaches ``S + W + 1 = 21`` (±10 %), and every later cut too, so
    the limit saw-tooths below that point. After ``POST /control/capacity`` lowers ``S``
    to 4 (live, no restart) the cuts come at the new ``S + W + 1 = 17``.

    A cut can come a step or two late: requests admitted together finish at the same
    engine step, and the client counts them in flight until it has read their ends,
    while the server has already freed their slots."""
    seqs, waiting, seqs_after = 8, 12, 4
    before, after = seqs + waiting + 1, seqs_after + waiting + 1
    with trio.fail_after(25):
        server = await start_server(nursery, max_num_seqs=seqs, max_waiting=waiting)
        config = LoadConfig(
            url=server.url,
            model=MODEL,
            adaptive="aimd",
            concurrency=seqs,
            duration=20.0,
            max_tokens=100,
            drain_timeout=5.0,
        )
        # The run's controller sees the records in the order the collector gets them, so
        # a twin fed from ``on_record`` counts the same cuts, as they happen.
        twin = AIMDController(initial=seqs)
        lowered = trio.Event()
        stop = trio.Event()
        cuts_at_change: list[int] = []

        def on_record(record: RequestRecord) -> None:
            decreases = twin.statistics().decreases
            twin.on_outcome(record.outcome)
            cuts = twin.statistics().decreases
            if cuts == decreases:
                return
            if cuts == 3:
                lowered.set()  # three cuts on the first point: lower the cap
            if cuts_at_change and cuts >= cuts_at_change[0] + 4:
                stop.set()  # four cuts since: enough

        async def lower_the_cap() -> None:
            await lowered.wait()
            status, body = await request_json(
                server.url, "POST", "/control/capacity", {"max_num_seqs": seqs_after}
            )
            assert status == 200 and body[0]["max_num_seqs"] == seqs_after
            cuts_at_change.append(twin.statistics().decreases)
            change_time.append(time.time())

        change_time: list[float] = []
        results: list[LoadResult] = []

        async def load() -> None:
            results.append(await run_load(config, on_record=on_record, stop=stop))

        async with trio.open_nursery() as inner:
            inner.start_soon(lower_the_cap)
            inner.start_soon(load)
        result = results[0]
        assert change_time, "the run ended before the cap was lowered"
        t_change = change_time[0] - result.started_at

        assert result.controller is not None
        assert result.controller.decreases == twin.statistics().decreases
        peaks = cut_peaks(result, hi=t_change)
        assert len(peaks) >= 3, result.limit_changes
        assert abs(peaks[0] - before) <= 0.1 * before, peaks  # the first 529
        assert all(abs(p - before) <= 0.1 * before for p in peaks), peaks
        # below the point: no limit above it (+10 %) was ever reached before the change
        assert max(v for t, v in result.limit_changes if t < t_change) <= 1.1 * before
        # The first cut after the change may still be on the old point (requests running
        # above the new cap drain first); from then on the cuts follow the new one.
        later = cut_peaks(result, lo=t_change)[1:]
        assert len(later) >= 3, result.limit_changes
        assert all(abs(p - after) <= 0.1 * after for p in later), (later, after)
