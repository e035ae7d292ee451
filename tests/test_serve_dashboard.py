"""The live dashboard (:mod:`inference_lab.serve.dashboard`), in memory on the virtual clock:
the samples a page is pushed follow the runtime (batch, queue, 529s, capacity changes,
latency window, a dead engine), one sampler serves every page, memory is bounded, streams
end on shutdown, and the page sits behind the control plane's gate."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from inference_lab.serve.app import SAMPLER_KEY
from inference_lab.serve.dashboard import LATENCY_WINDOW, RING_SAMPLES, SAMPLE_INTERVAL, Sampler
from inference_lab.serve.settings_env import settings_from_env
from tests.conftest import GPT, LLAMA, Served, ServeFactory, Stream, chat_body, make_settings

TOKEN = "s3cret-token"


class Events:
    """A GET of the event stream on an in-memory connection: its parsed events."""

    def __init__(self, s: Served, query: str = "", headers: tuple[tuple[bytes, bytes], ...] = ()):
        self.stream = Stream(s.app, "/control/dashboard/events", b"")
        self.stream.scope["method"] = "GET"
        self.stream.scope["query_string"] = query.encode()
        self.stream.scope["headers"] = [(b"host", b"localhost"), *headers]
        self.buffer = b""
        self.pending: list[tuple[str, Any]] = []

    def start(self, nursery: trio.Nursery) -> None:
        self.stream.start(nursery)

    async def next(self) -> tuple[str, Any]:
        """The next event as (name, decoded data)."""
        while not self.pending:
            chunk = await self.stream.next_chunk()
            assert chunk is not None, "the stream ended"
            self.buffer += chunk
            *whole, self.buffer = self.buffer.split(b"\n\n")
            for event in whole:
                name, data = event.split(b"\n", 1)
                assert name.startswith(b"event: ") and data.startswith(b"data: "), event
                self.pending.append((name[7:].decode(), json.loads(data[6:])))
        return self.pending.pop(0)

    async def sample_where(self, condition: Any, limit: int = 400) -> dict[str, Any]:
        for _ in range(limit):
            name, data = await self.next()
            if name == "sample" and condition(data):
                return dict(data)
        raise AssertionError("no such sample")


def sampler_of(s: Served) -> Sampler:
    sampler = s.app.extensions[SAMPLER_KEY]
    assert isinstance(sampler, Sampler)
    return sampler


async def test_pushed_samples_follow_the_batch_the_queue_the_529s_and_capacity_changes(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With max_num_seqs 2 and max_waiting 1, three long streams show 2 running and 1
    queued, a fourth request's 529 shows as refused (total and per second), and a
    /control/capacity change is in the next sample, on the samples' time axis."""
    async with serve(make_settings(max_num_seqs=2, max_waiting=1)) as s:
        sampler = sampler_of(s)
        async with trio.open_nursery() as nursery:
            events = Events(s)
            events.start(nursery)
            name, init = await events.next()
            assert name == "init" and init["model"] == GPT and init["models"] == [GPT]
            assert init["interval"] == SAMPLE_INTERVAL
            for _ in range(3):
                Stream(s.app, "/v1/chat/completions", json.dumps(
                    chat_body(max_tokens=3000, stream=True)).encode()).start(nursery)  # fmt: skip
            full = await events.sample_where(lambda d: d["running"] == 2 and d["queued"] == 1)
            assert full["max_num_seqs"] == 2 and full["max_waiting"] == 1 and full["alive"]
            assert full["waiting_places"] == 1 and full["refused"] == 0
            refused = await s.post("/v1/chat/completions", chat_body())
            assert refused.status_code == 529
            after = await events.sample_where(lambda d: d["refused"] == 1)
            assert after["refused_per_s"] > 0
            assert after["admitted"] == 3
            posted_at = trio.current_time()
            answer = await s.post("/control/capacity", {"max_num_seqs": 3})
            assert answer.status_code == 200
            changed = await events.sample_where(lambda d: "changes" in d)
            assert changed["max_num_seqs"] == 3
            assert changed["changes"] == [
                {
                    "t": round(posted_at - sampler.started, 4),
                    "max_num_seqs": 3,
                    "max_waiting": 1,
                }
            ]
            three = await events.sample_where(lambda d: d["running"] == 3)
            assert three["queued"] == 0
            nursery.cancel_scope.cancel()


async def test_a_page_that_connects_later_gets_the_history_and_the_changes(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The init event carries the model's samples so far and its capacity changes."""
    async with serve(make_settings()) as s:
        await s.post("/control/capacity", {"max_waiting": 7})
        await trio.sleep(10 * SAMPLE_INTERVAL + 0.01)
        async with trio.open_nursery() as nursery:
            events = Events(s, "model=" + GPT)
            events.start(nursery)
            name, init = await events.next()
            assert name == "init"
            assert len(init["history"]) == sampler_of(s).seq >= 10
            assert [h["seq"] for h in init["history"]] == list(range(1, sampler_of(s).seq + 1))
            assert [(c["max_num_seqs"], c["max_waiting"]) for c in init["changes"]] == [(256, 7)]
            name, nxt = await events.next()
            assert name == "sample" and nxt["seq"] == init["history"][-1]["seq"] + 1
            nursery.cancel_scope.cancel()


async def test_tokens_and_latency_percentiles_come_from_the_engine(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Tokens emitted count every choice (n = 2 included); TTFT and E2E percentiles are
    those of the requests that finished in the window, and empty once it has passed."""
    async with serve(make_settings()) as s:
        metrics = s.state.metrics.models[GPT]
        for body in (
            chat_body(max_tokens=5),
            chat_body(max_tokens=7, n=2),
            chat_body(max_tokens=9),
        ):
            assert (await s.post("/v1/chat/completions", body)).status_code == 200
        assert metrics.tokens_emitted == 5 + 2 * 7 + 9
        async with trio.open_nursery() as nursery:
            events = Events(s)
            events.start(nursery)
            await events.next()
            sample = await events.sample_where(lambda d: d["latency_n"] == 3)
            ttft = np.array([r[1] for r in metrics.recent]) * 1e3
            e2e = np.array([r[2] for r in metrics.recent]) * 1e3
            assert sample["ttft_p50_ms"] == round(float(np.percentile(ttft, 50)), 3)
            assert sample["ttft_p99_ms"] == round(float(np.percentile(ttft, 99)), 3)
            assert sample["e2e_p90_ms"] == round(float(np.percentile(e2e, 90)), 3)
            later = await events.sample_where(
                lambda d: d["t"] > LATENCY_WINDOW + 1, limit=int(LATENCY_WINDOW * 8)
            )
            assert later["latency_n"] == 0 and later["ttft_p50_ms"] is None
            assert later["tokens_per_s"] == 0
            nursery.cancel_scope.cancel()


async def test_a_dead_engine_is_sampled_as_not_alive_with_nothing_running(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Rule 6: after the engine stops, samples say alive false, nothing running or queued,
    no KV use; requests then count as 503s per second."""
    async with serve(make_settings()) as s:
        async with trio.open_nursery() as nursery:
            events = Events(s)
            events.start(nursery)
            await events.next()
            Stream(s.app, "/v1/chat/completions", json.dumps(
                chat_body(max_tokens=3000, stream=True)).encode()).start(nursery)  # fmt: skip
            await events.sample_where(lambda d: d["running"] == 1 and d["kv_usage"] > 0)
            s.runtime().kill()
            assert (await s.post("/v1/chat/completions", chat_body())).status_code == 503
            dead = await events.sample_where(lambda d: not d["alive"])
            assert dead["running"] == 0 and dead["queued"] == 0 and dead["kv_usage"] == 0
            assert dead["unavailable_per_s"] > 0
            nursery.cancel_scope.cancel()


async def test_every_page_gets_the_same_bytes_of_one_sample_per_tick(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Rule 1: two pages get identical frames; the sampler took one sample per tick
    whatever the number of pages."""
    async with serve(make_settings()) as s:
        sampler = sampler_of(s)
        async with trio.open_nursery() as nursery:
            pages = [Events(s), Events(s)]
            for p in pages:
                p.start(nursery)
                await p.next()
            got = [[await p.next() for _ in range(8)] for p in pages]
            assert got[0] == got[1]
            assert sampler.streams == 2
            assert sampler.ticks == sampler.seq
            start = sampler.started
            assert sampler.ticks == int((trio.current_time() - start) / SAMPLE_INTERVAL) + 1
            nursery.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert sampler.streams == 0


async def test_the_ring_is_bounded_and_a_late_page_gets_only_what_it_holds(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Rule 2: a model keeps RING_SAMPLES samples; the history sent is those."""
    async with serve(make_settings()) as s:
        sampler = sampler_of(s)
        await trio.sleep((RING_SAMPLES + 50) * SAMPLE_INTERVAL)
        assert len(sampler.tracks[GPT].ring) == RING_SAMPLES
        async with trio.open_nursery() as nursery:
            events = Events(s)
            events.start(nursery)
            _, init = await events.next()
            assert len(init["history"]) == RING_SAMPLES
            assert init["history"][0]["seq"] == sampler.seq - RING_SAMPLES + 1
            nursery.cancel_scope.cancel()


async def test_streams_end_with_an_end_event_when_the_server_stops(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Rule 5: stopping the app's state (what a shutdown's drain does) ends every stream
    with ``end`` and a complete body."""
    async with serve(make_settings()) as s:
        async with trio.open_nursery() as nursery:
            events = Events(s)
            events.start(nursery)
            await events.next()
            await events.next()
            await s.state.stop()
            while True:
                name, data = await events.next()
                if name == "end":
                    break
            assert data == {"reason": "the server is shutting down"}
            assert await events.stream.next_chunk() is None
            assert events.stream.ended
            await events.stream.app_done.wait()


async def test_the_model_selector_switches_models_and_an_unknown_one_is_a_404(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(make_settings(GPT, LLAMA)) as s:
        async with trio.open_nursery() as nursery:
            events = Events(s, "model=" + LLAMA)
            events.start(nursery)
            _, init = await events.next()
            assert init["model"] == LLAMA and init["models"] == [GPT, LLAMA]
            nursery.cancel_scope.cancel()
        response = await s.client.get("/control/dashboard/events?model=nope")
        assert response.status_code == 404
        body = json.loads(await response.get_data())
        assert body["error"]["code"] == "model_not_found"


async def test_a_page_without_a_model_opens_on_the_busiest(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Rule 7: with two models served, an idle server opens on the first; once the second
    runs requests (and the first none), a page naming no model opens on the second; with
    both idle again, the one that admitted more wins over the order."""
    async with serve(make_settings(GPT, LLAMA)) as s:
        async with trio.open_nursery() as nursery:
            idle = Events(s)
            idle.start(nursery)
            _, init = await idle.next()
            assert init["model"] == GPT and init["models"] == [GPT, LLAMA]
            streams = [
                Stream(s.app, "/v1/chat/completions", json.dumps(
                    chat_body(model=LLAMA, max_tokens=3000, stream=True)).encode())
                for _ in range(2)
            ]  # fmt: skip
            for stream in streams:
                stream.start(nursery)
            llama = Events(s, "model=" + LLAMA)
            llama.start(nursery)
            await llama.sample_where(lambda d: d["running"] + d["queued"] == 2)
            busy = Events(s)
            busy.start(nursery)
            _, init = await busy.next()
            assert init["model"] == LLAMA
            for stream in streams:
                await stream.disconnect()
            # once LLAMA's engine is idle again, its admissions decide
            await llama.sample_where(lambda d: d["running"] + d["queued"] == 0)
            nursery.cancel_scope.cancel()
        assert s.state.runtimes[GPT].snapshot().admitted == 0
        assert s.state.runtimes[LLAMA].snapshot().running == 0
        assert sampler_of(s).busiest() == LLAMA


async def test_the_page_is_self_contained_and_its_csp_allows_exactly_its_scripts(
    serve: ServeFactory,
) -> None:
    """No URL to another origin; every inline script and style is in the CSP by hash."""
    async with serve(make_settings()) as s:
        response = await s.client.get("/control/dashboard")
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        assert response.headers["cache-control"] == "no-store"
        csp = response.headers["content-security-policy"]
        html = (await response.get_data()).decode()
    assert "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, re.S)
    assert len(scripts) == 3 and len(styles) == 2
    for text in scripts + styles:
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp
    assert "uPlot" in scripts[0] and "github.com/leeoniya/uPlot" in scripts[0]


async def test_no_dashboard_means_404s_and_no_sampler(serve: ServeFactory) -> None:
    settings = attrs.evolve(make_settings(), dashboard=False)
    async with serve(settings) as s:
        assert s.app.extensions[SAMPLER_KEY] is None
        for path in ("/control/dashboard", "/control/dashboard/events"):
            response = await s.client.get(path)
            assert response.status_code == 404, path
        assert s.state.stop_hooks == []


@pytest.mark.parametrize(
    ("path", "auth", "status"),
    [
        ("/control/dashboard", None, 401),
        ("/control/dashboard?token=wrong", None, 403),
        ("/control/dashboard?token=" + TOKEN, None, 200),
        ("/control/dashboard", f"Bearer {TOKEN}", 200),
        ("/control/dashboard/events?model=nope&token=" + TOKEN, None, 404),
        ("/control/dashboard/events?model=nope&token=x", None, 403),
        # ?token= stands for the header on the dashboard's paths only
        ("/control/capacity?token=" + TOKEN, None, 401),
        ("/control/stats?token=" + TOKEN, None, 401),
    ],
)
async def test_with_a_control_token_the_dashboard_needs_it_in_the_header_or_the_query(
    serve: ServeFactory, path: str, auth: str | None, status: int
) -> None:
    settings = attrs.evolve(make_settings(), control_token=TOKEN)
    async with serve(settings) as s:
        headers = {"authorization": auth} if auth else {}
        response = await s.client.get(path, headers=headers)
        assert response.status_code == status


async def test_without_a_token_the_dashboard_answers_loopback_only(serve: ServeFactory) -> None:
    async with serve(make_settings()) as s:
        response = await s.client.get("/control/dashboard", scope_base={"client": ("10.1.2.3", 5)})
        assert response.status_code == 403
        response = await s.client.get("/control/dashboard", headers={"host": "evil.example"})
        assert response.status_code == 403


def test_the_environment_turns_the_dashboard_off_and_fine_buckets_on() -> None:
    env = {"INFERENCE_LAB_CONFIG": "configs/gpt-oss-20b.toml"}
    default = settings_from_env(env)
    assert default.dashboard and not default.fine_latency_buckets
    flipped = settings_from_env(
        {**env, "INFERENCE_LAB_NO_DASHBOARD": "1", "INFERENCE_LAB_FINE_LATENCY_BUCKETS": "yes"}
    )
    assert not flipped.dashboard and flipped.fine_latency_buckets


def test_the_module_loads_what_its_percentiles_would_import_inside_a_tick() -> None:
    """np.percentile's first call imports numpy.ma (tens of milliseconds, measured 31 ms
    inside a running server's first tick with latencies): the dashboard's module loads it
    itself, in a fresh interpreter as the server's is."""
    code = "import sys, inference_lab.serve.dashboard; print('numpy.ma' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
