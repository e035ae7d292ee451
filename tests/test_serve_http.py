"""The HTTP surface: endpoints, error envelopes and their check order, and the exact
streaming / non-streaming wire formats. Through the in-memory Quart client; the
completion routes' answers also through a real socket (the ``serve_both`` fixture), the
path ``inference-lab serve`` takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.conftest import GPT, LLAMA, ServeFactory, chat_body, make_settings
from tests.serve_util import split_frames

JSON = "application/json"
QUICK_WORKLOAD = str(Path(__file__).resolve().parent.parent / "configs/workloads/quick.toml")


def envelope(data: bytes) -> dict[str, Any]:
    body = json.loads(data)
    assert list(body) == ["error"]
    assert list(body["error"]) == ["message", "type", "param", "code"]
    error: dict[str, Any] = body["error"]
    return error


async def expect_error(response: Any, status: int, code: str, param: str | None) -> dict[str, Any]:
    assert response.status_code == status
    assert response.headers["content-type"] == JSON
    error = envelope(await response.get_data())
    assert (error["code"], error["param"]) == (code, param)
    return error


# -- simple endpoints ---------------------------------------------------------------------------


async def test_models_lists_every_model_in_load_order(serve: ServeFactory) -> None:
    async with serve(make_settings(GPT, LLAMA)) as s:
        status, body = await s.get_json("/v1/models")
    assert status == 200
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [GPT, LLAMA]
    for model in body["data"]:
        assert list(model) == ["id", "object", "created", "owned_by", "max_model_len"]
        assert model["object"] == "model" and model["owned_by"] == "inference-lab"
        assert isinstance(model["created"], int) and model["created"] > 1_600_000_000


async def test_health_is_ok_while_every_engine_runs(serve: ServeFactory) -> None:
    async with serve() as s:
        response = await s.client.get("/health")
        assert response.status_code == 200
        assert await response.get_data() == b'{"status":"ok"}'


async def test_health_is_503_naming_a_stopped_engine(serve: ServeFactory) -> None:
    async with serve(make_settings(GPT, LLAMA)) as s:
        s.runtime(LLAMA).stop()
        status, body = await s.get_json("/health")
    assert status == 503
    assert body == {"status": "unavailable", "models": {GPT: "running", LLAMA: "stopped"}}


# -- routing errors -----------------------------------------------------------------------------


async def test_unknown_path_is_404_not_found(serve: ServeFactory) -> None:
    async with serve() as s:
        error = await expect_error(await s.client.get("/v2/x"), 404, "not_found", None)
    assert error["message"] == "No route for GET /v2/x"
    assert error["type"] == "invalid_request_error"


async def test_wrong_method_is_405_method_not_allowed(serve: ServeFactory) -> None:
    async with serve() as s:
        response = await s.client.get("/v1/completions")
        error = await expect_error(response, 405, "method_not_allowed", None)
        assert error["message"] == "Method GET not allowed on /v1/completions"
        assert "POST" in response.headers["allow"]
        response = await s.client.delete("/control/capacity")
        await expect_error(response, 405, "method_not_allowed", None)


async def test_body_over_2_mib_is_413(serve_both: ServeFactory) -> None:
    async with serve_both() as s:
        response = await s.post_raw("/v1/chat/completions", b" " * (2 * 1024 * 1024 + 1))
        error = await expect_error(response, 413, "request_too_large", None)
    assert error["message"] == "Request body exceeds 2097152 bytes"


async def test_body_of_exactly_2_mib_is_read(serve_both: ServeFactory) -> None:
    """The limit is inclusive: a 2 MiB body is parsed (and here fails as not-an-object)."""
    async with serve_both() as s:
        response = await s.post_raw(
            "/v1/chat/completions", b"[" + b" " * (2 * 1024 * 1024 - 2) + b"]"
        )
        await expect_error(response, 400, "invalid_json", None)


async def test_invalid_json_is_400(serve_both: ServeFactory) -> None:
    async with serve_both() as s:
        error = await expect_error(
            await s.post_raw("/v1/completions", b"nope"), 400, "invalid_json", None
        )
    assert error["message"].startswith("Request body must be a JSON object: Expecting value")


async def test_invalid_field_is_400_with_param(serve_both: ServeFactory) -> None:
    async with serve_both() as s:
        response = await s.post("/v1/chat/completions", chat_body(max_tokens=10.5))
        error = await expect_error(response, 400, "invalid_value", "max_tokens")
    assert error["message"] == "max_tokens must be an integer in 1..2147483647, got 10.5"


async def test_best_of_and_prompt_count_errors(serve: ServeFactory) -> None:
    async with serve() as s:
        response = await s.post("/v1/chat/completions", chat_body(n=3, best_of=4))
        await expect_error(response, 400, "unsupported_value", "best_of")
        response = await s.post("/v1/completions", {"model": GPT, "prompt": []})
        error = await expect_error(response, 400, "invalid_prompt", "prompt")
        assert error["message"] == "prompt must hold at least one prompt"
        two = {"model": GPT, "prompt": ["a", "b"], "stream": True}
        response = await s.post("/v1/completions", two)
        error = await expect_error(response, 400, "unsupported_value", "stream")
    assert error["message"].startswith("a stream takes one prompt")


async def test_unknown_model_is_404_listing_the_models(serve_both: ServeFactory) -> None:
    async with serve_both(make_settings(GPT, LLAMA)) as s:
        response = await s.post("/v1/chat/completions", chat_body(model="x"))
        error = await expect_error(response, 404, "model_not_found", "model")
    assert error["message"] == f"Model 'x' not found. Available models: {GPT}, {LLAMA}"


async def test_prompt_plus_max_tokens_over_max_seq_len_is_400(serve: ServeFactory) -> None:
    async with serve() as s:
        response = await s.post("/v1/chat/completions", chat_body(max_tokens=131072))
        error = await expect_error(response, 400, "context_length_exceeded", "max_tokens")
    assert "131072" in error["message"] and "131077" in error["message"]
    assert "max_seq_len" in error["message"]


async def test_request_over_the_kv_cache_is_400(serve: ServeFactory) -> None:
    """A KV cache of 10 blocks of 64 tokens holds no 1000-token request."""
    settings = make_settings(kv_cache_capacity=10 * 1_572_864)
    async with serve(settings) as s:
        response = await s.post("/v1/chat/completions", chat_body(max_tokens=1000))
        error = await expect_error(response, 400, "context_length_exceeded", "max_tokens")
    assert "KV" in error["message"] and "10" in error["message"]


async def test_check_order_validation_model_fit_alive(serve_both: ServeFactory) -> None:
    """validation (400) -> model (404) -> fit (400) -> engine alive (503): the first
    failing check answers."""
    async with serve_both() as s:
        s.runtime().stop()
        bad_everything = chat_body(model="x", max_tokens=1.5)
        await expect_error(
            await s.post("/v1/chat/completions", bad_everything), 400, "invalid_value", "max_tokens"
        )
        unknown_and_too_long = chat_body(model="x", max_tokens=200_000)
        await expect_error(
            await s.post("/v1/chat/completions", unknown_and_too_long),
            404,
            "model_not_found",
            "model",
        )
        too_long_dead = chat_body(max_tokens=200_000)
        await expect_error(
            await s.post("/v1/chat/completions", too_long_dead),
            400,
            "context_length_exceeded",
            "max_tokens",
        )
        response = await s.post("/v1/chat/completions", chat_body())
        error = await expect_error(response, 503, "engine_unavailable", None)
    assert error == {
        "message": f"The engine for model '{GPT}' is not running.",
        "type": "service_unavailable_error",
        "param": None,
        "code": "engine_unavailable",
    }


# -- wire formats ---------------------------------------------------------------------------------


def _chunk_head(frame: dict[str, Any], obj: str) -> None:
    assert list(frame)[:4] == ["id", "object", "created", "model"]
    assert frame["object"] == obj and frame["model"] == GPT


@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_stream_frames(serve_both: ServeFactory, include_usage: bool) -> None:
    """role frame, one content frame per token (the last one's word without its trailing
    space, so the streamed text is the non-streaming text), finish frame, usage frame only
    when asked for, then [DONE]; every event exactly `data: <compact JSON>\\n\\n`; one id."""
    body = chat_body(max_tokens=3, stream=True, stream_options={"include_usage": include_usage})
    async with serve_both() as s, s.stream(body) as stream:
        await stream.read_all()
        assert stream.status == 200
        assert stream.headers["content-type"] == "text/event-stream"
        assert stream.headers["cache-control"] == "no-cache"
    payloads = stream.frames()
    assert payloads[-1] == b"[DONE]"
    frames = [json.loads(p) for p in payloads[:-1]]
    for raw, frame in zip(payloads, frames, strict=False):
        assert raw == json.dumps(frame, separators=(",", ":")).encode()
        _chunk_head(frame, "chat.completion.chunk")
    assert len({f["id"] for f in frames}) == 1 and frames[0]["id"].startswith("chatcmpl-")
    assert frames[0]["choices"] == [{"index": 0, "delta": {"role": "assistant"}}]
    assert [f["choices"] for f in frames[1:4]] == [
        [{"index": 0, "delta": {"content": word}}] for word in ("the ", "of ", "and")
    ]
    assert frames[4]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]
    if include_usage:
        assert len(frames) == 6
        assert frames[5]["choices"] == []
        assert frames[5]["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    else:
        assert len(frames) == 5


@pytest.mark.parametrize("include_usage", [False, True])
async def test_completions_stream_frames(serve_both: ServeFactory, include_usage: bool) -> None:
    body = {
        "model": GPT,
        "prompt": "hello world",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": include_usage},
    }
    async with serve_both() as s, s.stream(body, "/v1/completions") as stream:
        await stream.read_all()
    payloads = stream.frames()
    assert payloads[-1] == b"[DONE]"
    frames = [json.loads(p) for p in payloads[:-1]]
    for frame in frames:
        _chunk_head(frame, "text_completion")
        assert frame["id"].startswith("cmpl-")
    assert [f["choices"] for f in frames[:3]] == [
        [{"text": "the ", "index": 0}],
        [{"text": "of", "index": 0}],
        [{"text": "", "index": 0, "finish_reason": "length"}],
    ]
    if include_usage:
        assert frames[3]["choices"] == [] and frames[3]["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    assert len(frames) == (4 if include_usage else 3)


async def test_completions_stream_echo_sends_the_prompt_first(serve_both: ServeFactory) -> None:
    body = {"model": GPT, "prompt": "hi", "max_tokens": 1, "stream": True, "echo": True}
    async with serve_both() as s, s.stream(body, "/v1/completions") as stream:
        await stream.read_all()
    frames = [json.loads(p) for p in stream.frames()[:-1]]
    assert frames[0]["choices"] == [{"text": "hi", "index": 0}]
    assert frames[1]["choices"] == [{"text": "the", "index": 0}]


async def test_chat_non_streaming_body(serve_both: ServeFactory) -> None:
    async with serve_both() as s:
        response = await s.post("/v1/chat/completions", chat_body(max_completion_tokens=3))
        assert response.status_code == 200
        assert response.headers["content-type"] == JSON
        data = await response.get_data()
    body = json.loads(data)
    assert data == json.dumps(body, separators=(",", ":")).encode()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "the of and"},
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completions_non_streaming_body_with_echo(serve_both: ServeFactory) -> None:
    async with serve_both() as s:
        response = await s.post(
            "/v1/completions",
            {"model": GPT, "prompt": "hello world", "max_tokens": 2, "echo": True},
        )
        body = json.loads(await response.get_data())
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"text": "hello worldthe of", "index": 0, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_default_max_tokens_sets_the_response_length(serve_both: ServeFactory) -> None:
    async with serve_both(make_settings(default_max_tokens=7)) as s:
        response = await s.post("/v1/chat/completions", chat_body(max_tokens=None))
        body = json.loads(await response.get_data())
    assert body["usage"]["completion_tokens"] == 7


def _fixed_workload(tmp_path: Path, value: int) -> str:
    path = tmp_path / "fixed.toml"
    path.write_text(
        'arrival_pattern = "batched"\nnum_requests = 1\n'
        'input_len_dist = { type = "fixed", value = 8 }\n'
        f'output_len_dist = {{ type = "fixed", value = {value} }}\nseed = 1\n'
    )
    return str(path)


async def test_workload_lengths_finish_with_stop_below_max_tokens(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """With --workload a response runs to min(sample, max_tokens): `stop` when the sample
    is shorter, `length` when max_tokens cuts it."""
    settings = make_settings(workload=_fixed_workload(tmp_path, 3))
    async with serve(settings) as s:
        short = json.loads(
            await (await s.post("/v1/chat/completions", chat_body(max_tokens=10))).get_data()
        )
        cut = json.loads(
            await (await s.post("/v1/chat/completions", chat_body(max_tokens=2))).get_data()
        )
        async with s.stream(chat_body(max_tokens=10, stream=True)) as stream:
            await stream.read_all()
    assert short["choices"][0]["finish_reason"] == "stop"
    assert short["usage"]["completion_tokens"] == 3
    assert short["choices"][0]["message"]["content"] == "the of and"
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 2
    frames = [json.loads(p) for p in stream.frames()[:-1]]
    assert frames[-1]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert len(frames) == 1 + 3 + 1


async def test_workload_lengths_are_seeded_per_model(serve: ServeFactory) -> None:
    """The same seed draws the same response lengths."""
    workload = QUICK_WORKLOAD
    runs = []
    for _ in range(2):
        async with serve(make_settings(workload=workload, seed=7)) as s:
            lengths = []
            for _ in range(3):
                response = await s.post(
                    "/v1/chat/completions", chat_body(max_tokens=100_000 // 1000)
                )
                lengths.append(json.loads(await response.get_data())["usage"]["completion_tokens"])
            runs.append(lengths)
    assert runs[0] == runs[1]
    assert all(1 <= n <= 100 for n in runs[0])


async def test_stream_writes_coalesce_frames_due_together(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The last token, finish frame, usage frame and [DONE] leave in one write."""
    body = chat_body(max_tokens=2, stream=True, stream_options={"include_usage": True})
    async with serve() as s, s.stream(body) as stream:
        await stream.read_all()
    last_write = split_frames(stream.chunks[-1][1])
    assert len(last_write) == 4 and last_write[-1] == b"[DONE]"
    assert json.loads(last_write[0])["choices"][0]["delta"] == {"content": "of"}


async def test_priority_field_reaches_the_engine(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With the priority policy a lower `priority` waiting request is admitted first."""
    settings = make_settings(policy="priority", max_num_seqs=1)
    order: list[str] = []
    async with serve(settings) as s:
        async with s.stream(chat_body(max_tokens=5, stream=True)) as first:
            await first.next_chunk()  # admitted, running alone

            async def run(name: str, priority: int) -> None:
                body = chat_body(max_tokens=1, stream=True, priority=priority)
                async with s.stream(body) as stream:
                    await stream.read_all()
                order.append(name)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "low", 5)
                nursery.start_soon(run, "high", -5)
                await first.read_all()
    assert order == ["high", "low"]
