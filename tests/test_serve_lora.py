"""LoRA adapters over HTTP (serve/lora.py, serve/lora_routes.py): the flags, /v1/models'
adapter cards, requests naming adapters, the runtime load/unload routes and their errors,
vllm:lora_requests_info read by prometheus_client, the KV events' lora fields decoded with
vLLM's declarations, and the openai SDK naming adapters on a real socket."""

from __future__ import annotations

import argparse
import json
from typing import Any

import attrs
import msgspec
import openai
import pytest
import trio
import trio.testing
import zmq
from prometheus_client.parser import text_string_to_metric_families

from inference_lab import cli
from inference_lab.core.config import LoraAdapter
from inference_lab.core.engine.lora import adapter_hashes
from inference_lab.errors import ConfigError
from inference_lab.serve import ServeSettings, kv_wire
from inference_lab.serve.kv_events import KVEventsSettings
from inference_lab.serve.lora import (
    LoraFlags,
    apply_lora,
    lora_flags,
    parse_lora_module,
    runtime_updating,
)
from tests.serve_util import running_server
from tests.test_serve_kv_events import Subscriber, WireStored, decode_exact

from .conftest import LLAMA, ServeFactory, make_settings

ADAPTERS = ("sql", "chat", "code")


def lora_settings(
    updating: bool = True, scheduler: dict[str, Any] | None = None, **flags: Any
) -> ServeSettings:
    settings = make_settings(LLAMA, **(scheduler or {}))
    modules = tuple(LoraAdapter(name=n, path=f"/adapters/{n}") for n in ADAPTERS)
    values = {"enable": True, "modules": modules, "max_loras": 2, **flags}
    deployments = apply_lora(settings.deployments, LoraFlags(**values))
    return attrs.evolve(settings, deployments=tuple(deployments), lora_updating=updating)


def chat(model: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello " * 20}],
        "max_tokens": max_tokens,
        **extra,
    }


async def error_of(response: Any) -> tuple[int, dict[str, Any]]:
    return response.status_code, json.loads(await response.get_data())["error"]


async def test_models_lists_adapters_with_their_parent(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(lora_settings()) as s:
        status, body = await s.get_json("/v1/models")
        assert status == 200
        cards = {c["id"]: c for c in body["data"]}
        assert set(cards) == {LLAMA, *ADAPTERS}
        assert cards["sql"]["parent"] == LLAMA and cards["sql"]["root"] == "/adapters/sql"
        assert "parent" not in cards[LLAMA]
        status, card = await s.get_json("/v1/models/code")
        assert (status, card["id"], card["parent"]) == (200, "code", LLAMA)


async def test_a_request_naming_an_adapter_runs_it_and_an_unknown_one_is_404(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(lora_settings()) as s:
        response = await s.post("/v1/chat/completions", chat("sql"))
        body = json.loads(await response.get_data())
        assert response.status_code == 200 and body["model"] == "sql"
        lora = s.state.runtimes[LLAMA].engine.statistics().workers[0].lora
        assert lora is not None and lora.loads == 1 and lora.resident == ("sql",)
        response = await s.post(
            "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 3}
        )
        assert response.status_code == 200
        status, error = await error_of(await s.post("/v1/chat/completions", chat("nope")))
        assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
        # /tokenize counts an adapter's prompt with its base model's tokenizer
        base = await s.post("/tokenize", {"model": LLAMA, "prompt": "hello world"})
        adapter = await s.post("/tokenize", {"model": "code", "prompt": "hello world"})
        assert adapter.status_code == 200
        assert json.loads(await adapter.get_data()) == json.loads(await base.get_data())


async def test_the_messages_api_runs_an_adapter_as_chat_does(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """``/v1/messages`` and its ``count_tokens`` take an adapter's name, as vLLM's
    Messages handler (a chat completion underneath) does: the adapter is loaded for the
    request, the answer names it, and its prompt is counted by the base model's
    tokenizer; an unknown name is Anthropic's 404."""
    message = {"messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 4}
    async with serve(lora_settings()) as s:
        response = await s.post("/v1/messages", {"model": "code", **message})
        body = json.loads(await response.get_data())
        assert response.status_code == 200 and body["model"] == "code"
        lora = s.state.runtimes[LLAMA].engine.statistics().workers[0].lora
        assert lora is not None and lora.loads == 1 and lora.resident == ("code",)
        counts = []
        for model in (LLAMA, "code"):
            counted = await s.post("/v1/messages/count_tokens", {"model": model, **message})
            assert counted.status_code == 200
            counts.append(json.loads(await counted.get_data())["input_tokens"])
        assert counts[0] == counts[1] == body["usage"]["input_tokens"]
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            missing = await s.post(path, {"model": "nope", **message})
            error = json.loads(await missing.get_data())["error"]
            assert (missing.status_code, error["type"]) == (404, "not_found_error")


async def test_load_and_unload_answer_as_vllm(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(lora_settings(max_cpu_loras=3)) as s:
        ok = await s.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/x/new"})
        assert ok.status_code == 200
        assert await ok.get_data() == b"Success: LoRA adapter 'new' added successfully."
        # past max_cpu_loras (3): loaded; the host cache drops its least recently used
        status, body = await s.get_json("/v1/models")
        assert "new" in {c["id"] for c in body["data"]}
        response = await s.post("/v1/chat/completions", chat("new"))
        assert response.status_code == 200
        for bad, message in (
            (
                {"lora_name": "new", "lora_path": "/y"},
                "The lora adapter 'new' has already been loaded.",
            ),
            ({"lora_name": "x"}, "Both 'lora_name' and 'lora_path' must be provided."),
            ({"lora_name": "big", "lora_path": "/b", "rank": 64}, "LoRA rank 64 is greater"),
        ):
            status, error = await error_of(await s.post("/v1/load_lora_adapter", bad))
            assert status == 400 and error["message"].startswith(message)
        status, error = await error_of(await s.post("/v1/unload_lora_adapter", {"lora_name": "zz"}))
        assert (status, error["type"]) == (404, "NotFoundError")
        assert error["message"] == "The lora adapter 'zz' cannot be found."
        status, error = await error_of(await s.post("/v1/unload_lora_adapter", {}))
        assert status == 400 and error["type"] == "InvalidUserInput"
        gone = await s.post("/v1/unload_lora_adapter", {"lora_name": "new"})
        assert await gone.get_data() == b"Success: LoRA adapter 'new' removed successfully."
        status, error = await error_of(await s.post("/v1/chat/completions", chat("new")))
        assert status == 404


async def test_unloading_an_adapter_in_use_lets_its_requests_finish(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(lora_settings()) as s:
        async with s.stream(chat("sql", max_tokens=50, stream=True)) as st:
            first = await st.next_frames()
            assert json.loads(first[0])["model"] == "sql"
            gone = await s.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
            assert gone.status_code == 200
            await st.read_all()
        frames = st.frames()
        assert frames[-1] == b"[DONE]" and len(frames) > 40


async def test_without_the_variable_the_runtime_routes_do_not_exist(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    assert runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"})
    assert not runtime_updating({})
    async with serve(lora_settings(updating=False)) as s:
        response = await s.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})
        assert response.status_code == 404


async def test_lora_requests_info_is_read_by_prometheus_client(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(lora_settings(scheduler={"max_num_seqs": 1})) as s:
        async with s.stream(chat("sql", max_tokens=50, stream=True)) as st:
            await st.next_frames()
            async with s.stream(chat("code", max_tokens=5, stream=True)) as waiting:
                await trio.sleep(0.05)
                text = (await (await s.client.get("/metrics")).get_data()).decode()
                families = {f.name: f for f in text_string_to_metric_families(text)}
                info = families["vllm:lora_requests_info"]
                assert info.type == "gauge"
                (sample,) = info.samples
                assert sample.labels == {
                    "max_lora": "2",
                    "waiting_lora_adapters": "code",
                    "running_lora_adapters": "sql",
                }
                assert sample.value > 1.7e9  # a Unix time, as vLLM sets it
                await st.read_all()
                await waiting.read_all()
    async with serve(make_settings(LLAMA)) as s:  # no LoRA: no such family
        text = (await (await s.client.get("/metrics")).get_data()).decode()
        assert "vllm:lora_requests_info" not in text


def test_kv_events_carry_the_adapter_as_vllm_declares_it() -> None:
    event = kv_wire.stored([11, 12], None, [1, 2], 16, "full_attention", lora_id=3, lora_name="sql")
    payload = msgspec.msgpack.Encoder().encode(kv_wire.batch(1.0, [event], 0))
    (decoded,) = decode_exact(payload).events
    assert isinstance(decoded, WireStored)
    assert (decoded.lora_id, decoded.lora_name) == (3, "sql")
    assert decoded.extra_keys == [("sql",), ("sql",)]


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("sql=/a/sql", LoraAdapter(name="sql", path="/a/sql")),
        (
            '{"name": "x", "path": "/p", "base_model_name": "m", "rank": 8}',
            LoraAdapter(name="x", path="/p", base_model_name="m", rank=8),
        ),
    ],
)
def test_lora_modules_specs(item: str, expected: LoraAdapter) -> None:
    assert parse_lora_module(item) == expected


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("sql", "invalid JSON format"),
        ("=/p", "invalid format"),
        ("a=b=c", "invalid format"),
        ('{"name": "x"}', "invalid fields"),
        ('{"name": "x", "path": "/p", "weights": 1}', "invalid fields"),
        ('{"name": "x", "path": "/p", "rank": 0}', "rank must be an integer >= 1"),
    ],
)
def test_bad_lora_modules_are_one_line_errors(item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_lora_module(item)
    assert str(info.value).startswith("--lora-modules: ") and "\n" not in str(info.value)


def test_flags_need_enable_lora_and_check_vllms_bounds() -> None:
    with pytest.raises(ConfigError, match="--max-loras: needs --enable-lora"):
        lora_flags(argparse.Namespace(enable_lora=False, max_loras=2))
    deps = make_settings(LLAMA).deployments
    with pytest.raises(ConfigError, match="--max-lora-rank: must be one of"):
        apply_lora(deps, LoraFlags(enable=True, max_lora_rank=7))
    with pytest.raises(ConfigError, match="--max-cpu-loras: must be >= max_loras"):
        apply_lora(deps, LoraFlags(enable=True, max_loras=4, max_cpu_loras=2))
    with pytest.raises(ConfigError, match="base_model_name 'other' is not a served model"):
        apply_lora(deps, LoraFlags(enable=True, modules=(parse_lora_module(
            '{"name": "x", "path": "/p", "base_model_name": "other"}'
        ),)))  # fmt: skip


def test_serve_refuses_a_bad_spec_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["serve", "--config", "Llama-3.1-8B-Instruct", "--enable-lora",
                     "--lora-modules", "sql=/a", "broken"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and "--lora-modules: invalid JSON format 'broken'" in err
    assert len(err.strip().splitlines()) == 1


async def test_the_openai_sdk_names_adapters_on_a_real_socket() -> None:
    with trio.fail_after(30):
        async with running_server(lora_settings()) as (url, _, state):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            models = await client.models.list()
            assert {m.id for m in models.data} == {LLAMA, *ADAPTERS}
            answer = await client.chat.completions.create(
                model="code", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert answer.model == "code" and answer.usage is not None
            assert answer.usage.completion_tokens == 3
            stream = await client.completions.create(
                model="sql", prompt="select", max_tokens=3, stream=True
            )
            assert [c async for c in stream]
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(
                    model="unknown", messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
            lora = state.runtimes[LLAMA].engine.statistics().workers[0].lora
            assert lora is not None and set(lora.resident) == {"code", "sql"}


class LoraSubscriber(Subscriber):
    """The KV-event test subscriber (live and replayed batches, in order), keeping every
    stored event it decodes with vLLM's declarations."""

    def __init__(self, *args: Any) -> None:
        self.stored: list[WireStored] = []
        super().__init__(*args)

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.last + 1, (seq, self.last)
        self.last = seq
        self.stored += [e for e in decode_exact(payload).events if isinstance(e, WireStored)]


async def test_a_subscriber_sees_each_adapters_blocks_with_its_tokens(serve: ServeFactory) -> None:
    """A real ZeroMQ subscriber: an adapter's stored blocks carry its id and name, and
    their token ids are the request's, hashed as the base model's chain and then with the
    adapter's name (the engine's lora Rule 4); the same prompt through two adapters and the
    base model stores three distinct chains."""
    settings = attrs.evolve(
        lora_settings(),
        kv_events=KVEventsSettings(
            endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="t"
        ),
    )
    ctx = zmq.Context()
    try:
        with trio.fail_after(60):
            async with serve(settings) as s:
                publisher = s.state.kv_events.publishers[LLAMA]  # type: ignore[union-attr]
                sub = LoraSubscriber(ctx, publisher.endpoint, publisher.replay_endpoint or "", b"t")
                prompt = "tell me more " * 60
                for model in ("sql", "chat", LLAMA):
                    response = await s.post("/v1/chat/completions", chat(model) | {
                        "messages": [{"role": "user", "content": prompt}]})  # fmt: skip
                    assert response.status_code == 200
                with trio.fail_after(10):
                    while sub.last < publisher.statistics().batches - 1:
                        if not await trio.to_thread.run_sync(sub.take, 200):
                            await trio.to_thread.run_sync(
                                sub.fill_gap, publisher.statistics().batches
                            )
                sub.disconnect()
                sub.replay.close(linger=0)
                firsts = {}
                for event in sub.stored:
                    if event.parent_block_hash is None:
                        firsts[event.lora_name] = event
                assert set(firsts) == {"sql", "chat", None}
                assert firsts["sql"].lora_id == 1 and firsts["chat"].lora_id == 2
                base = firsts[None]
                for name in ("sql", "chat"):
                    event = firsts[name]
                    assert event.token_ids == base.token_ids  # the same prompt's tokens
                    assert event.block_hashes == list(
                        adapter_hashes(tuple(base.block_hashes), name)
                    )
                assert publisher.statistics().missing_tokens == 0
    finally:
        ctx.destroy(linger=0)
