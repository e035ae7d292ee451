"""``/v1/embeddings`` in memory (``docs/agents.md``): deterministic unit vectors, their
formats, and their price: each input is a prefill-only request through the engine and
its admission. Time-dependent tests run on the autojump MockClock."""

from __future__ import annotations

import base64
import json
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from inference_lab.api.embeddings import MAX_EMBEDDING_VALUES, MAX_INPUTS
from inference_lab.api.requests import count_text_tokens
from tests.conftest import GPT, ServeFactory, chat_body, make_settings

HIDDEN = 2880  # gpt-oss-20b's hidden_dim: the default vector length


def body(input_: Any = "hello world", **extra: Any) -> dict[str, Any]:
    return {"model": GPT, "input": input_, **extra}


async def embed(s: Any, request: dict[str, Any]) -> tuple[int, Any]:
    response = await s.post("/v1/embeddings", request)
    return response.status_code, json.loads(await response.get_data())


async def test_vectors_are_deterministic_unit_vectors_per_input(serve: ServeFactory) -> None:
    """One unit vector of the model's ``hidden_dim`` per input, in order; the same input
    gives the same vector (in any batch), another input another; usage counts the
    inputs' prompt tokens."""
    inputs = ["the cat", "a dog", "the cat"]
    async with serve() as s:
        status, response = await embed(s, body(inputs))
        _, alone = await embed(s, body("a dog"))
    assert status == 200
    assert response["object"] == "list" and response["model"] == GPT
    data = response["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in data)
    vectors = [np.array(d["embedding"]) for d in data]
    for v in vectors:
        assert v.shape == (HIDDEN,)
        assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)
    assert vectors[0].tolist() == vectors[2].tolist()
    assert abs(float(vectors[0] @ vectors[1])) < 0.2
    assert alone["data"][0]["embedding"] == data[1]["embedding"]
    tokens = sum(count_text_tokens(t) for t in inputs)
    assert response["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


async def test_token_id_inputs_count_exactly(serve: ServeFactory) -> None:
    async with serve() as s:
        _, one = await embed(s, body([1, 2, 3, 4]))
        _, two = await embed(s, body([[1, 2], [3, 4, 5]]))
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == 4
    assert len(two["data"]) == 2 and two["usage"]["prompt_tokens"] == 5


async def test_base64_is_the_float32_bytes_of_the_same_vector(serve: ServeFactory) -> None:
    async with serve() as s:
        _, floats = await embed(s, body("hello", dimensions=16))
        _, packed = await embed(s, body("hello", dimensions=16, encoding_format="base64"))
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (16,)
    assert decoded.tolist() == pytest.approx(floats["data"][0]["embedding"], abs=1e-7)


async def test_dimensions_truncate_and_renormalise(serve: ServeFactory) -> None:
    """``dimensions`` keeps the first components scaled to unit length: a shorter vector
    points the way the longer one's prefix does."""
    async with serve() as s:
        _, full = await embed(s, body("hello"))
        _, short = await embed(s, body("hello", dimensions=64))
        status, error = await embed(s, body("hello", dimensions=HIDDEN + 1))
    head = np.array(full["data"][0]["embedding"][:64])
    small = np.array(short["data"][0]["embedding"])
    assert np.linalg.norm(small) == pytest.approx(1.0, abs=1e-6)
    assert small == pytest.approx(head / np.linalg.norm(head), abs=1e-6)
    assert status == 400 and error["error"]["param"] == "dimensions"


async def test_the_seed_and_the_configured_dimension_apply(serve: ServeFactory) -> None:
    async with serve() as s:
        _, base = await embed(s, body("hello"))
    async with serve(attrs.evolve(make_settings(), seed=3, embedding_dim=8)) as s:
        _, other = await embed(s, body("hello"))
    assert len(other["data"][0]["embedding"]) == 8
    assert other["data"][0]["embedding"] != base["data"][0]["embedding"][:8]


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        (body(""), "input"),
        (body([]), "input"),
        (body(["a", ""]), "input[1]"),
        (body([[]]), "input[0]"),
        (body(["a", 1]), "input"),
        (body(["a"] * (MAX_INPUTS + 1)), "input"),
        (body("a", encoding_format="binary"), "encoding_format"),
        (body("a", dimensions=0), "dimensions"),
        ({"input": "a"}, "model"),
        (body("word " * 140_000), "input"),
    ],
)
async def test_bad_requests_are_400s_naming_the_field(
    serve: ServeFactory, request_body: dict[str, Any], param: str
) -> None:
    async with serve() as s:
        status, error = await embed(s, request_body)
        assert status == 400, error
        assert error["error"]["param"] == param
        assert s.runtime().snapshot().admitted == 0


async def test_the_values_one_request_asks_for_are_capped(serve: ServeFactory) -> None:
    """inputs x dimensions past MAX_EMBEDDING_VALUES is a 400 before anything is admitted
    (the body would be tens of MB)."""
    dim = 1 << 20
    inputs = MAX_EMBEDDING_VALUES // dim + 1
    async with serve(attrs.evolve(make_settings(), embedding_dim=dim)) as s:
        status, error = await embed(s, body(["a"] * inputs))
        assert status == 400 and error["error"]["param"] == "input"
        assert f"{MAX_EMBEDDING_VALUES:,}" in error["error"]["message"]
        assert s.runtime().snapshot().admitted == 0
        status, _ = await embed(s, body(["a"] * inputs, dimensions=8))
        assert status == 200
        assert s.runtime().snapshot().admitted == inputs


async def test_an_embedding_costs_one_prefill_step(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Alone on an idle engine, an embeddings request of P tokens answers when the
    prefill step over P positions ends: the time a one-token completion of P tokens takes."""
    prompt = list(range(300))
    async with serve() as s:
        t0 = trio.current_time()
        status, _ = await embed(s, body(prompt))
        embedded = trio.current_time() - t0
        finished = s.runtime().statistics().engine
        assert status == 200 and finished.finished == 1 and finished.steps == 1
    async with serve() as s:
        t0 = trio.current_time()
        response = await s.post(
            "/v1/completions", {"model": GPT, "prompt": prompt, "max_tokens": 1}
        )
        assert response.status_code == 200
        completed = trio.current_time() - t0
    assert embedded == pytest.approx(completed, rel=1e-12) and embedded > 0


async def test_a_batch_is_admitted_whole_or_refused_whole(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With the batch full and one waiting place, a batch of two inputs is a 529 and
    nothing of it stays admitted; a batch of one is admitted, waits its turn and
    answers. Embeddings count toward max_waiting like any request."""
    async with serve(make_settings(max_num_seqs=1, max_waiting=1)) as s:
        rt = s.runtime()
        async with s.stream(chat_body(max_tokens=60, stream=True)) as running:
            await running.next_chunk()
            await running.next_chunk()
            before = rt.snapshot()
            status, error = await embed(s, body(["a", "b"]))
            assert status == 529 and error["error"]["code"] == "queue_saturated"
            after = rt.snapshot()
            assert (after.admitted, after.aborted, after.queued) == (
                before.admitted,
                before.aborted,
                before.queued,
            )
            assert after.refused == before.refused + 1
            async with trio.open_nursery() as nursery:
                results: list[int] = []

                async def one() -> None:
                    results.append((await embed(s, body("a")))[0])

                nursery.start_soon(one)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.snapshot().depth == 1
                status, _ = await embed(s, body("b"))  # the waiting place is taken
                assert status == 529
                await running.read_all()
            assert results == [200]


async def test_a_dead_engine_is_a_503(serve: ServeFactory) -> None:
    async with serve() as s:
        s.runtime().kill()
        status, error = await embed(s, body(["a", "b"]))
        assert status == 503 and error["error"]["code"] == "engine_unavailable"


async def test_embeddings_appear_in_metrics_like_other_requests(serve: ServeFactory) -> None:
    """Each input is a finished request in ``/metrics`` (success counter, prompt tokens,
    one generated token the answer does not return)."""
    async with serve() as s:
        await embed(s, body([[1, 2, 3], [4, 5]]))
        response = await s.client.get("/metrics")
        text = (await response.get_data()).decode()
    lines = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    label = f'{{engine="0",model_name="{GPT}"}}'
    assert lines[f"vllm:prompt_tokens_total{label}"] == 5
    assert lines[f"vllm:generation_tokens_total{label}"] == 2
    success = (
        f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{GPT}"}}'
    )
    assert lines[success] == 2


async def test_a_client_leaving_aborts_every_input(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(make_settings(max_num_seqs=1)) as s:
        rt = s.runtime()
        async with s.stream(chat_body(max_tokens=20, stream=True)) as running:
            await running.next_chunk()
            await running.next_chunk()
            async with s.stream(body(["a", "b", "c"]), path="/v1/embeddings") as batch:
                await trio.testing.wait_all_tasks_blocked()
                assert rt.snapshot().queued == 3
            await trio.testing.wait_all_tasks_blocked()
            snap = rt.snapshot()
            assert (snap.queued, snap.aborted) == (0, 3)
            await running.read_all()
        assert batch.status is None  # nothing was sent
