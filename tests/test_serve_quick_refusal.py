"""A completion request refused with a 529 where its bytes are read
(``serve/quick_refusal.py``, ``transport/quick.py``): in the scheduling batch whose read
brought it, with the route's very answer and accounting; every other outcome -- and every
request the quick path leaves (split over two reads, a model with room, a bad body, a
fault header, agent fields, several prompts) -- answered by the route. Real sockets on
127.0.0.1 under ``trio.fail_after``; nothing here reads a clock's value."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

from inference_lab.core.admission import Admission
from inference_lab.core.config import load_deployment
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.serve import asgi
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport.connection import ReceiptStream
from tests.conftest import CONFIG_FILES, GPT, LLAMA, make_settings
from tests.serve_util import running_server
from tests.test_serve_health import batches_of_work, read_answer
from tests.transport_util import h11_answers


class NullSink:
    def on_tokens(self, count: int) -> None:
        pass

    def on_finished(self, finished: Any) -> None:
        pass

    def on_failed(self, message: str) -> None:
        pass


def post(path: str, body: Any, *headers: str) -> bytes:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    extra = "".join(f"{h}\r\n" for h in headers)
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n{extra}\r\n"
    ).encode() + payload


def chat(model: str = LLAMA, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


@asynccontextmanager
async def llama_full(
    origins: tuple[str, ...] = (), pinned_tokens: int = 4000
) -> AsyncIterator[tuple[int, ServeState]]:
    """A server of gpt-oss-20b and Llama-3-70B (each ``max_num_seqs`` 1, ``max_waiting``
    1) whose Llama queue is full: one long request (``pinned_tokens``) runs, one waits."""
    settings = make_settings(GPT, LLAMA, max_num_seqs=1, max_waiting=1)
    settings = attrs.evolve(settings, allowed_origins=origins)
    async with running_server(settings) as (_, port, state):
        runtime = state.runtimes[LLAMA]
        for _ in range(2):
            runtime.admit_nowait(
                prompt_tokens=8, max_tokens=pinned_tokens, priority=0, sink=NullSink()
            )
        assert runtime.at_bound() and not state.runtimes[GPT].at_bound()
        yield port, state


async def exchange(port: int, *writes: bytes) -> bytes:
    """Send ``writes`` (with a pause between, so they arrive as separate reads) on a new
    connection; the one answer."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    for k, data in enumerate(writes):
        if k:
            await trio.sleep(0.05)
        await stream.send_all(data)
    answer = await read_answer(stream)
    await stream.aclose()
    return answer


def comparable(answer: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    ((status, headers, body),) = h11_answers(answer, 1)
    named = {bytes(k).lower(): bytes(v) for k, v in headers}
    for name in (b"date", b"server"):
        named.pop(name, None)
    for moment in (b"inference-lab-pacing-lag-ms", b"retry-after"):
        assert named.pop(moment, None) is not None  # there; its value is the moment's
    return status, named, body


def refused_count(state: ServeState) -> int:
    return state.runtimes[LLAMA].snapshot().refused


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        ("/v1/chat/completions", chat(), ()),
        ("/v1/chat/completions", chat(stream=True, n=2), ("user-agent: storm",)),
        ("/v1/completions", {"model": LLAMA, "prompt": "hi", "max_tokens": 3}, ()),
        ("/v1/chat/completions", chat(), ("origin: https://ui.example",)),
    ],
    ids=["chat", "stream-n2", "completions", "cors"],
)
async def test_the_quick_refusal_is_the_routes(
    path: str, body: dict[str, Any], headers: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """quick_refusal Rules 1-2: the 529 written where the request is read and the route's
    529 to the same request (its body sent in a second read, which the quick path leaves)
    agree on status, headers (but the date, and the values of the moment's pacing lag and
    Retry-After) and body, and
    each is counted once as a refusal. The quick one is written with no scheduling batch
    between the read and the answer, with 32 tasks always runnable."""
    request = post(path, body, *headers, "x-request-id: same-id")
    head, _, payload = request.partition(b"\r\n\r\n")
    with trio.fail_after(30):
        async with llama_full(("https://ui.example",)) as (port, state):
            before = refused_count(state)
            async with batches_of_work() as counter:
                batches, quick = await _batches_to_answer(monkeypatch, port, counter, request)
            after_quick = refused_count(state)
            routed = await exchange(port, head + b"\r\n\r\n", payload)
            after_route = refused_count(state)
    assert batches == 0
    assert comparable(quick) == comparable(routed)
    status, named, answer = comparable(quick)
    assert status == 529 and named[b"x-request-id"] == b"same-id"
    assert json.loads(answer)["error"]["code"] == "queue_saturated"
    assert named[b"x-should-retry"] == b"false"
    if headers and headers[0].startswith("origin"):
        assert named[b"access-control-allow-origin"] == b"https://ui.example"
    assert (after_quick - before, after_route - after_quick) == (1, 1)


async def _batches_to_answer(
    monkeypatch: pytest.MonkeyPatch, port: int, counter: Any, request: bytes
) -> tuple[int, bytes]:
    read_at: list[int] = []
    wrote_at: list[int] = []
    plain_receive, plain_send = ReceiptStream.receive_some, ReceiptStream.send_nowait

    async def receive(self: ReceiptStream, max_bytes: int | None = None) -> Any:
        data = await plain_receive(self, max_bytes)
        if data:
            read_at.append(counter.count)
        return data

    def send_nowait(self: ReceiptStream, data: bytes) -> int:
        if read_at and not wrote_at:
            wrote_at.append(counter.count)
        return plain_send(self, data)

    monkeypatch.setattr(ReceiptStream, "receive_some", receive)
    monkeypatch.setattr(ReceiptStream, "send_nowait", send_nowait)
    try:
        answer = await exchange(port, request)
    finally:
        monkeypatch.setattr(ReceiptStream, "receive_some", plain_receive)
        monkeypatch.setattr(ReceiptStream, "send_nowait", plain_send)
    assert len(read_at) == 1 and len(wrote_at) == 1
    return wrote_at[0] - read_at[0], answer


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (post("/v1/chat/completions", b"{not json"), 400, "invalid_json"),
        (post("/v1/chat/completions", chat(max_tokens=-1)), 400, "invalid_value"),
        (post("/v1/chat/completions", chat("no-such-model")), 404, "model_not_found"),
        (post("/v1/chat/completions", chat(max_tokens=10**9)), 400, "context_length_exceeded"),
        (
            post("/v1/chat/completions", chat(stream=True), "x-inference-lab-fault: abort@3"),
            400,
            "invalid_fault_directive",
        ),
        (
            post("/v1/completions", {"model": LLAMA, "prompt": "x", "response_format": {}}),
            400,
            "unsupported_value",
        ),
        (
            post(
                "/v1/chat/completions",
                chat(tools=[{"type": "function", "function": {"name": "f"}}]),
            ),
            529,
            "queue_saturated",
        ),
        (post("/v1/completions", {"model": LLAMA, "prompt": ["a", "b"]}), 529, "queue_saturated"),
    ],
    ids=["json", "field", "model", "fit", "fault", "structured", "tools", "two-prompts"],
)
async def test_every_other_outcome_is_the_routes(
    request_bytes: bytes, status: int, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quick_refusal Rule 1: with a queue full, a request the route answers otherwise (a
    400, a 404, the harness's refusal of a fault header) or that the quick path leaves to
    the route (agent fields, several prompts) is answered by the route, with its own
    answer; the quick path is not even asked to write (no write before the route's
    task)."""
    offered: list[bytes] = []
    plain = asgi.InferenceLabApp.quick_post

    def spy(self: Any, *args: Any) -> Any:
        reply = plain(self, *args)
        offered.append(b"quick" if reply is not None else b"route")
        return reply

    monkeypatch.setattr(asgi.InferenceLabApp, "quick_post", spy)
    with trio.fail_after(30):
        async with llama_full() as (port, _state):
            answer = await exchange(port, request_bytes)
    ((got, _headers, body),) = h11_answers(answer, 1)
    assert (got, json.loads(body)["error"]["code"]) == (status, code)
    assert offered == [b"route"]


async def test_a_model_with_room_is_served_and_nothing_is_offered_while_none_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """quick_refusal Rule 3: while Llama's queue is full, a request for gpt-oss-20b (room
    for it) is offered and left to the route, which serves it (200); with no queue full,
    no request is offered at all."""
    offered: list[str] = []
    plain = asgi.InferenceLabApp.quick_post

    def spy(self: Any, path: str, *args: Any) -> Any:
        offered.append(path)
        return plain(self, path, *args)

    monkeypatch.setattr(asgi.InferenceLabApp, "quick_post", spy)
    served = post("/v1/chat/completions", chat(GPT, max_tokens=2))
    with trio.fail_after(30):
        async with llama_full() as (port, state):
            answer = await exchange(port, served)
            assert h11_answers(answer, 1)[0][0] == 200
            assert offered == ["/v1/chat/completions"]
            for runtime in state.runtimes.values():
                runtime.abort_live("test")
            await trio.sleep(0.1)
            assert not any(r.at_bound() for r in state.runtimes.values())
            answer = await exchange(port, post("/v1/chat/completions", chat(max_tokens=2)))
            assert h11_answers(answer, 1)[0][0] == 200
            assert offered == ["/v1/chat/completions"]


def test_refuses_decides_as_admit_and_changes_nothing() -> None:
    """admission Rule 6: over a run of arrivals against a bound, ``refuses`` says exactly
    what ``admit`` then does, and asking it moves neither the ledger nor a round robin
    over two replicas."""
    dep = load_deployment(CONFIG_FILES[LLAMA], "b200")
    dep = attrs.evolve(
        dep,
        scheduler=attrs.evolve(dep.scheduler, max_num_seqs=2, max_waiting=3),
        hardware=attrs.evolve(dep.hardware, replicas=2),
    )
    engine = Engine(dep)
    ledger = Admission(engine, max_waiting=3)
    decisions = []
    for k in range(12):
        spec = RequestSpec(prompt_tokens=100 + 900 * (k % 3), max_tokens=50, n=1 + k % 2)
        said = ledger.refuses(spec)
        rr = engine._router.rr
        assert ledger.refuses(spec) == said and engine._router.rr == rr
        decisions.append(said)
        assert (ledger.admit(object(), spec) is None) == said
    assert True in decisions and False in decisions


async def test_a_quick_answer_that_raises_leaves_the_request_to_the_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """quick Rule 3: were the quick path to raise (a defect, not an input: every bad input
    is an ApiError it leaves to the route), the request is answered by the route -- the
    same 529, counted once -- and the connection stays usable."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a defect of the quick path")

    monkeypatch.setattr(asgi, "quick_refusal", broken)
    request = post("/v1/chat/completions", chat())
    with trio.fail_after(30):
        async with llama_full() as (port, state):
            before = refused_count(state)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            answers = []
            for _ in range(2):  # twice on one connection: it was not dropped
                await stream.send_all(request)
                answers.append(await read_answer(stream))
            await stream.aclose()
            after = refused_count(state)
    for answer in answers:
        status, _, body = comparable(answer)
        assert status == 529 and json.loads(body)["error"]["code"] == "queue_saturated"
    assert after - before == 2


def _mutated_bodies(seed: int, count: int) -> list[tuple[str, bytes]]:
    """``count`` request bodies drawn from valid and invalid variations of a chat and a
    completions request for the full model (never the model with room, whose route would
    admit them and change the server's state)."""
    import random

    rng = random.Random(seed)
    values: dict[str, list[Any]] = {
        "stream": [True, False, "yes", None],
        "n": [1, 2, 3, 0, -1, 1.5, "2"],
        "max_tokens": [1, 16, 0, -5, 10**9, "8", None, 3.0],
        "temperature": [0, 0.7, 2.5, -1, "hot"],
        "top_p": [0.5, 1.5],
        "logprobs": [True, False, 3],
        "top_logprobs": [0, 5, 50],
        "stop": ["\n", ["a", "b"], [1], ""],
        "seed": [7, -1, "x"],
        "priority": [0, 5, "high"],
        "min_tokens": [0, 4, 10**9],
        "ignore_eos": [True, "no"],
        "stream_options": [{"include_usage": True}, {"bogus": 1}, 3],
        "user": ["u", 5],
        "unknown_key": [1, {"a": [1, 2]}],
        "kv_transfer_params": [{"do_remote_decode": True}, {"do_remote_prefill": 5}, "x"],
        "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "nope"}],
        "tools": [[], [{"type": "function", "function": {"name": "f"}}], "x"],
        "tool_choice": ["none", "auto", {"type": "function"}],
    }
    messages: list[Any] = [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello " * 50}],
        [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        [{"role": "robot", "content": "hi"}],
        [],
        "hi",
        [{"role": "user"}],
    ]
    prompts: list[Any] = ["hi", "hi", [1, 2, 3], ["a"], [[1, 2]], "x" * 300, "", [], 5]
    models: list[Any] = [LLAMA] * 8 + ["nope", 7, None]
    out = []
    for _ in range(count):
        chat_path = rng.random() < 0.6
        body: dict[str, Any] = {"model": rng.choice(models)}
        if chat_path:
            body["messages"] = rng.choice(messages)
        else:
            body["prompt"] = rng.choice(prompts)
            if rng.random() < 0.3:
                body["echo"] = rng.choice([True, False])
        for key in rng.sample(sorted(values), rng.randint(0, 3)):
            body[key] = rng.choice(values[key])
        body = {k: v for k, v in body.items() if v is not None or rng.random() < 0.5}
        path = "/v1/chat/completions" if chat_path else "/v1/completions"
        payload = json.dumps(body).encode()
        if rng.random() < 0.05:
            payload = payload[: rng.randint(0, len(payload))]  # cut short: invalid JSON
        out.append((path, payload))
    return out


def _same_answer(answer: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """An answer with what depends on its moment taken out: the date, and the values (not
    the presence) of the pacing lag and Retry-After."""
    ((status, headers, body),) = h11_answers(answer, 1)
    named = {bytes(k).lower(): bytes(v) for k, v in headers}
    for name in (b"date", b"server"):
        named.pop(name, None)
    for moment in (b"inference-lab-pacing-lag-ms", b"retry-after"):
        if moment in named:
            named[moment] = b"(present)"
    return status, named, body


async def test_drawn_requests_get_the_routes_answer_whether_read_whole_or_not() -> None:
    """quick_refusal Rule 1, on 80 requests drawn from valid and invalid variations of
    chat and completions bodies: with the model's queue full, each request read in one
    read (the quick path may answer it) and the same request read in two (the route
    answers it) get the same status, headers and body, and the same number of
    refusals is counted for each."""
    with trio.fail_after(120):
        async with llama_full(pinned_tokens=100_000) as (port, state):
            for k, (path, payload) in enumerate(_mutated_bodies(seed=20261204, count=80)):
                assert state.runtimes[LLAMA].at_bound()  # full throughout
                request = post(path, payload, f"x-request-id: drawn-{k}")
                head, _, body = request.partition(b"\r\n\r\n")
                before = refused_count(state)
                whole = await exchange(port, request)
                after_whole = refused_count(state)
                split = await exchange(port, head + b"\r\n\r\n", body) if body else whole
                after_split = refused_count(state)
                assert _same_answer(whole) == _same_answer(split), (k, path, payload)
                if body:
                    assert after_whole - before == after_split - after_whole, (k, payload)
