"""vLLM's operational routes (``serve/ops.py``): ``/ping``, ``/load``, ``/invocations``,
``/reset_prefix_cache`` and sleep mode priced on the virtual clock (``/sleep`` levels 1
and 2, ``/wake_up`` with tags, ``/is_sleeping``), the development routes behind the
control plane's rules."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from inference_lab.serve.sleep_mode import (
    HOST_LINK_BYTES_PER_S,
    RELOAD_BYTES_PER_S,
    sleep_seconds,
    wake_seconds,
)
from tests.conftest import GPT, ServeFactory, chat_body, make_settings


async def call(s: Any, method: str, path: str, **query: Any) -> tuple[int, Any]:
    response = await getattr(s.client, method)(path, query_string=query)
    data = await response.get_data()
    return response.status_code, json.loads(data) if data else None


def test_sleep_and_wake_are_priced_by_the_weights_over_the_link() -> None:
    """Level 1 moves the weights over the host link both ways; level 2 discards them at
    no cost and reloads them from storage; the KV cache costs nothing."""
    dep = make_settings().deployments[0]
    weights = dep.resident_weight_bytes / dep.hardware.tp
    assert (
        sleep_seconds(dep, 1) == weights / HOST_LINK_BYTES_PER_S == pytest.approx(0.263, abs=1e-3)
    )
    assert sleep_seconds(dep, 2) == 0.0
    assert wake_seconds(dep, 1, ("weights", "kv_cache")) == weights / HOST_LINK_BYTES_PER_S
    assert wake_seconds(dep, 2, ("weights",)) == weights / RELOAD_BYTES_PER_S
    assert wake_seconds(dep, 2, ("kv_cache",)) == 0.0


async def test_ping_follows_health_and_load_counts_live_requests(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s:
        assert await call(s, "get", "/ping") == (200, {"status": "ok"})
        assert await call(s, "post", "/ping") == (200, {"status": "ok"})
        assert await call(s, "get", "/load") == (200, {"server_load": 0})
        async with s.stream(chat_body(max_tokens=50, stream=True)) as stream:
            await stream.next_chunk()
            assert await call(s, "get", "/load") == (200, {"server_load": 1})
            await stream.read_all()
        assert await call(s, "get", "/load") == (200, {"server_load": 0})
        s.runtime().kill()
        status, body = await call(s, "get", "/ping")
        assert status == 503 and body["models"] == {GPT: "stopped"}


async def test_reset_prefix_cache_drops_the_cached_blocks(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    long = chat_body("hello " * 200, max_tokens=4)
    async with serve() as s:
        await s.post("/v1/chat/completions", long)
        assert s.runtime().statistics().engine.workers[0].cached_blocks > 0
        assert await call(s, "post", "/reset_prefix_cache") == (200, {"reset": {GPT: True}})
        assert s.runtime().statistics().engine.workers[0].cached_blocks == 0
        again = json.loads(await (await s.post("/v1/chat/completions", long)).get_data())
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, error = await call(s, "post", "/reset_prefix_cache", model="nope")
        assert status == 404 and error["error"]["code"] == "model_not_found"
        status, error = await call(s, "post", "/reset_prefix_cache", reset_running_requests="true")
        assert status == 400 and error["error"]["param"] == "reset_running_requests"


async def test_sleep_aborts_refuses_and_wake_up_takes_its_priced_time(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """``/sleep`` (level 1, abort): the live stream ends with an error naming the sleep,
    new requests get 503 ``engine_sleeping``, the answer comes after the priced offload;
    ``/wake_up`` answers after the priced reload and the model serves again."""
    async with serve() as s:
        dep = s.runtime().deployment
        async with s.stream(chat_body(max_tokens=1000, stream=True)) as stream:
            await stream.next_chunk()
            t0 = trio.current_time()
            status, body = await call(s, "post", "/sleep", level=1)
            slept = trio.current_time() - t0
            await stream.read_all()
        assert status == 200 and body == {
            "level": 1,
            "seconds": {GPT: round(sleep_seconds(dep, 1), 6)},
        }
        assert slept == pytest.approx(sleep_seconds(dep, 1), abs=1e-9)
        last = json.loads(stream.frames()[-2])
        assert "put to sleep" in last["error"]["message"]
        assert await call(s, "get", "/is_sleeping") == (
            200,
            {"is_sleeping": True, "levels": {GPT: 1}},
        )
        status, error = await call(s, "post", "/v1/chat/completions")
        response = await s.post("/v1/chat/completions", chat_body())
        error = json.loads(await response.get_data())
        assert response.status_code == 503 and error["error"]["code"] == "engine_sleeping"
        assert response.headers["retry-after"] == "10"
        assert s.runtime().statistics().engine.kv_usage == 0.0
        t0 = trio.current_time()
        status, body = await call(s, "post", "/wake_up")
        assert trio.current_time() - t0 == pytest.approx(
            wake_seconds(dep, 1, ("weights",)), abs=1e-9
        )
        assert await call(s, "get", "/is_sleeping") == (
            200,
            {"is_sleeping": False, "levels": {GPT: 0}},
        )
        response = await s.post("/v1/chat/completions", chat_body())
        assert response.status_code == 200


async def test_level_two_wake_up_by_tags_and_wait_mode(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Level 2 sleeps at once and reloads its weights from storage at wake-up; a wake-up
    of the weights alone leaves the model asleep until its KV cache is back; in ``wait``
    mode the sleep lets the live request finish first."""
    async with serve() as s:
        dep = s.runtime().deployment
        async with s.stream(chat_body(max_tokens=20, stream=True)) as stream:
            await stream.next_chunk()
            status, body = await call(s, "post", "/sleep", level=2, mode="wait")
            await stream.read_all()
        assert json.loads(stream.frames()[-2])["choices"][0]["finish_reason"] == "length"
        assert body == {"level": 2, "seconds": {GPT: 0.0}}
        t0 = trio.current_time()
        await call(s, "post", "/wake_up", tags="weights")
        assert trio.current_time() - t0 == pytest.approx(wake_seconds(dep, 2, ("weights",)))
        assert (await call(s, "get", "/is_sleeping"))[1]["is_sleeping"] is True
        t0 = trio.current_time()
        await call(s, "post", "/wake_up", tags="kv_cache")
        assert trio.current_time() - t0 == 0.0
        assert (await call(s, "get", "/is_sleeping"))[1]["is_sleeping"] is False
        for query, param in (({"level": 3}, "level"), ({"mode": "keep"}, "mode")):
            status, error = await call(s, "post", "/sleep", **query)
            assert status == 400 and error["error"]["param"] == param
        status, error = await call(s, "post", "/wake_up", tags="everything")
        assert status == 400 and error["error"]["param"] == "tags"


async def test_the_development_routes_follow_the_control_planes_rules(
    serve: ServeFactory,
) -> None:
    """With a control token, ``/sleep``, ``/wake_up``, ``/is_sleeping`` and
    ``/reset_prefix_cache`` need it (vLLM serves them only in development mode); ``/ping``
    and ``/load`` are open even with an API key; ``/invocations`` needs the key."""
    settings = attrs.evolve(make_settings(), control_token="ctl", api_key="key")
    async with serve(settings) as s:
        for method, path in (
            ("post", "/sleep"),
            ("post", "/wake_up"),
            ("get", "/is_sleeping"),
            ("post", "/reset_prefix_cache"),
        ):
            status, error = await call(s, method, path)
            assert status == 401 and error["error"]["code"] == "missing_control_token", path
        response = await s.client.get("/is_sleeping", headers={"authorization": "Bearer ctl"})
        assert response.status_code == 200
        assert (await call(s, "get", "/ping"))[0] == 200
        assert (await call(s, "get", "/load"))[0] == 200
        response = await s.client.post("/invocations", json=chat_body())
        assert response.status_code == 401
    async with serve() as s:  # loopback, no token: a bodiless POST from a browser page
        status, _ = await call(s, "post", "/wake_up")
        assert status == 200
        response = await s.client.post("/sleep", headers={"origin": "http://evil.example"})
        assert response.status_code == 415  # a page's POST carries its Origin
        assert s.runtime().sleep_level == 0


async def test_invocations_answers_as_the_route_the_body_names(serve: ServeFactory) -> None:
    async with serve() as s:
        chat = json.loads(await (await s.post("/invocations", chat_body(max_tokens=3))).get_data())
        completion = {"model": GPT, "prompt": "hi", "max_tokens": 3}
        text = json.loads(await (await s.post("/invocations", completion)).get_data())
        embedded = {"model": GPT, "input": "hi", "dimensions": 4}
        vectors = json.loads(await (await s.post("/invocations", embedded)).get_data())
        response = await s.post("/invocations", {"model": GPT})
        error = json.loads(await response.get_data())
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert text["object"] == "text_completion" and text["id"].startswith("cmpl-")
    assert vectors["object"] == "list" and len(vectors["data"][0]["embedding"]) == 4
    assert response.status_code == 400 and "messages" in error["error"]["message"]
