"""The load client against the real server: ``create_app`` served by hypercorn's trio worker
on ``127.0.0.1:0`` in this process (``serve_app`` on ``bind_socket``, as ``inference-lab serve``).

What the client reports must agree with what the server did: its outcome counts match the
server's admission counters, a lone request is never faster than the engine's own timeline
for it, and every 529 the AIMD client gets comes when the server's queue (``max_waiting``)
is full, also after the batch cap is changed live.

Real sockets mean the real clock, and the machine may be busy: these tests assert only
what holds however late the server or the client runs (orderings, counts, lower bounds).
How close the measurements come to the roofline is measured by the benchmarks and the
experiments in ``scripts/``, not asserted here. Every test runs under ``trio.fail_after``
and the server (``tests/serve_util.py``'s ``serving``) is shut down when the test ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
from benchkit import post_capacity, request_json

from inference_lab.client.load import LoadConfig, LoadResult, RequestRecord, run_load
from inference_lab.core.config import Deployment, load_deployment
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.serve import ServeSettings, ServeState, create_app, get_state
from tests.configs_util import GPT_OSS_20B
from tests.serve_util import serving

MODEL = "gpt-oss-20b"


@attrs.frozen
class Server:
    url: str
    deployment: Deployment
    state: ServeState


@asynccontextmanager
async def server_for(**scheduler: Any) -> AsyncIterator[Server]:
    """gpt-oss-20b on b200 with ``[scheduler]`` overrides, served on a fresh port."""
    dep = load_deployment(GPT_OSS_20B, "b200")
    dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, **scheduler))
    app = create_app(ServeSettings(deployments=(dep,), run_to_max_tokens=True))
    async with serving(app) as port:
        yield Server(url=f"http://127.0.0.1:{port}", deployment=dep, state=get_state(app))


def overlapping(records: tuple[RequestRecord, ...], r: RequestRecord) -> int:
    """How many admitted (not 529'd) attempts overlapped ``r`` on the client's clock."""
    return sum(
        1
        for p in records
        if p is not r and p.outcome != "overloaded" and p.start < r.end and p.end > r.start
    )


# ---------------------------------------------------------------------------------------


async def test_outcome_counts_match_the_servers_admissions() -> None:
    """Against ``max_num_seqs 4, max_waiting 4`` and 40 closed-loop workers, every request
    the client counts as ``ok`` is one the server admitted and finished, and every 529 it
    counts is one the server refused: no request is lost, double-counted or misclassified,
    and afterwards the server holds nothing."""
    with trio.fail_after(60):
        async with server_for(max_num_seqs=4, max_waiting=4) as server:
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
                {
                    "model": MODEL,
                    "max_waiting": 4,
                    "max_num_seqs": 4,
                    "waiting": 0,
                    "queued": 0,
                    "running": 0,
                }
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


async def test_lone_request_is_never_faster_than_the_engine() -> None:
    """A request alone on the server streams its first token no sooner than one prefill
    step after it arrives, and its last no sooner than the decode steps the engine prices:
    the server never runs ahead of wall-clock, and the client only ever adds time. Every
    token the request asked for arrives, each after the one before."""
    with trio.fail_after(30):
        async with server_for() as server:
            config = LoadConfig(
                url=server.url, model=MODEL, concurrency=1, requests=4, max_tokens=100
            )
            result = await run_load(config)
            records: list[RequestRecord] = list(result.records)
            assert [r.outcome for r in records] == ["ok"] * 4
            prompt = records[0].prompt_tokens
            assert prompt is not None
            ttft_pred, e2e_pred = engine_timeline(server.deployment, prompt, 100)
            assert 0.001 < ttft_pred < e2e_pred  # a real prefill step, then 99 decode steps
            for r in records:
                assert r.ttft is not None and r.ttft >= ttft_pred - 0.0005, (r.ttft, ttft_pred)
                assert r.e2e >= e2e_pred - 0.0005, (r.e2e, e2e_pred)
                assert len(r.token_times) == r.completion_tokens == 100
                assert list(r.token_times) == sorted(r.token_times)


async def test_aimd_client_is_refused_only_by_a_full_queue() -> None:
    """The AIMD client against ``max_num_seqs S = 8, max_waiting W = 12``: every 529 it gets
        comes when the server's queue is full, so at least ``W`` other requests of the client
        were held by the server then, and the limit had reached ``W + 1`` or more at the first
        cut. After ``POST /control/capacity`` lowers ``S`` to 4 (live, no restart) the run goes
        on and is refused again; the client's 529 count is the server's refusal count (up to the
    requests the stop cancelled).

        "Held" is checked on the client's clock: a request the server held when it refused
        another was sent before the refusal was read and ended after the refused one was sent,
        so the two overlap. In steady state the server also runs ``S`` requests when it
        refuses (the cuts come at ``S + W + 1``), but a refusal can fall between an engine step
        that left the batch part-empty and the next one, so ``S`` is not a bound the client can
        check whatever the timing; ``scripts/adaptive_experiment.py`` measures the cut points."""
    seqs, waiting, seqs_after = 8, 12, 4
    with trio.fail_after(120):
        async with server_for(max_num_seqs=seqs, max_waiting=waiting) as server:
            config = LoadConfig(
                url=server.url,
                model=MODEL,
                adaptive="aimd",
                concurrency=seqs,
                duration=100.0,  # a bound only: the run is stopped by events below
                max_tokens=50,
                drain_timeout=5.0,
            )
            lowered = trio.Event()
            stop = trio.Event()
            changed: list[bool] = []
            refused_after_change: list[RequestRecord] = []

            def on_record(record: RequestRecord) -> None:
                if record.outcome != "overloaded":
                    return
                lowered.set()  # the first 529: lower the cap
                if changed:
                    refused_after_change.append(record)
                    if len(refused_after_change) >= 3:
                        stop.set()

            async def lower_the_cap() -> None:
                await lowered.wait()
                body = await post_capacity(server.url, model=MODEL, max_num_seqs=seqs_after)
                assert body[0]["max_num_seqs"] == seqs_after
                changed.append(True)

            results: list[LoadResult] = []

            async def load() -> None:
                results.append(await run_load(config, on_record=on_record, stop=stop))

            async with trio.open_nursery() as inner:
                inner.start_soon(lower_the_cap)
                inner.start_soon(load)
            result = results[0]

            assert result.interrupted, "the run ended before three 529s after the change"
            changes = result.limit_changes
            first_cut = next(
                prev
                for (_, prev), (_, new) in zip(changes, changes[1:], strict=False)
                if new < prev
            )
            assert first_cut >= waiting + 1, changes
            refused = [r for r in result.records if r.outcome == "overloaded"]
            for r in refused:
                assert overlapping(result.records, r) >= waiting, r
            assert result.controller is not None and result.controller.overloads == len(refused)
            # A request cancelled by the stop may have been refused before its answer was read.
            cancelled = sum(1 for r in result.records if r.outcome == "cancelled")
            snap = server.state.runtimes[MODEL].snapshot()
            assert len(refused) <= snap.refused <= len(refused) + cancelled
            assert snap.max_num_seqs == seqs_after
