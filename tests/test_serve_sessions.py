"""A request's session in ``serve`` (``api/requests.py`` Rule 5): ``prompt_cache_key``,
else ``user`` (on ``/v1/messages``, ``metadata.user_id``), keys the ``session_affinity``
router, so a session's requests find the replica holding their prefix."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs
import pytest
import trio.testing

from inference_lab.api.messages_request import parse_messages_request
from inference_lab.api.requests import parse_chat_request, session_key
from inference_lab.api.responses_request import parse_responses_request
from inference_lab.core.engine.router import draw
from tests.conftest import GPT, LLAMA, ServeFactory, make_settings

REPLICAS = 4
PROMPT = [{"role": "user", "content": "route me " * 200}]


def first_seed() -> int:
    """A router seed under which ``random``'s first two arrivals go to different
    replicas (so a request without a session finds nothing cached the second time)."""
    return next(s for s in range(100) if draw(s, 0) % REPLICAS != draw(s, 1) % REPLICAS)


def apart(seed: int) -> tuple[str, str]:
    """Two session keys whose sessions the router sends to different replicas."""
    keys = [f"user-{i}" for i in range(100)]
    home = {k: draw(seed, session_key(k) or 0) % REPLICAS for k in keys}
    a = keys[0]
    return a, next(k for k in keys if home[k] != home[a])


def settings_with(seed: int) -> Any:
    settings = make_settings(LLAMA, hardware="h100")
    dep = settings.deployments[0]
    hw = attrs.evolve(dep.hardware, replicas=REPLICAS, router="session_affinity", router_seed=seed)
    return attrs.evolve(settings, deployments=(attrs.evolve(dep, hardware=hw),))


async def cached_second_time(s: Any, first: dict[str, Any], second: dict[str, Any]) -> int:
    for extra in (first, second):
        body = {"model": LLAMA, "messages": PROMPT, "max_tokens": 4, **extra}
        response = await s.post("/v1/chat/completions", body)
        assert response.status_code == 200
        data = json.loads(await response.get_data())
    cached: int = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


@pytest.mark.parametrize(
    ("first", "second", "hits"),
    [
        ({"user": "alice"}, {"user": "alice"}, True),
        ({"prompt_cache_key": "k"}, {"prompt_cache_key": "k", "user": "other"}, True),
        ({}, {}, False),  # no session: placed as random places it
        ("apart-a", "apart-b", False),
    ],
)
async def test_a_session_keeps_its_replica(
    serve: ServeFactory,
    autojump_clock: trio.testing.MockClock,
    first: Any,
    second: Any,
    hits: bool,
) -> None:
    """Under session_affinity the same session's resend lands on the replica that cached
    its prompt; no session, or two sessions the router keeps apart, find nothing cached.
    Fails if serve hands the router no session (every case would be random's)."""
    seed = first_seed()
    if first == "apart-a":
        a, b = apart(seed)
        first, second = {"user": a}, {"user": b}
    async with serve(settings_with(seed)) as s:
        assert (await cached_second_time(s, first, second) > 0) == hits


def test_the_session_is_the_keys_digest_with_prompt_cache_key_first() -> None:
    digest = int.from_bytes(hashlib.blake2b(b"alice", digest_size=8).digest(), "big")
    assert session_key("alice") == digest
    assert session_key(None, "alice") == digest
    assert session_key("", "alice") == digest  # an empty key is no key
    assert session_key(None, None) is None
    chat = {"model": GPT, "messages": PROMPT, "prompt_cache_key": "alice", "user": "bob"}
    assert parse_chat_request(chat, 16).session == digest
    assert parse_chat_request({"model": GPT, "messages": PROMPT}, 16).session is None
    responses = {"model": GPT, "input": "hi", "user": "alice"}
    assert parse_responses_request(responses, 16).parsed.session == digest
    messages = {
        "model": GPT,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "alice"},
    }
    assert parse_messages_request(messages).parsed.session == digest


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": PROMPT, "max_tokens": 4, "user": 7}, "user"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "prompt_cache_key": []}, None),
        ("/v1/responses", {"input": "hi", "prompt_cache_key": 3}, "prompt_cache_key"),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": PROMPT, "metadata": {"user_id": 1}},
            "metadata.user_id",
        ),
    ],
)
async def test_a_key_that_is_not_a_string_is_a_400_naming_it(
    serve: ServeFactory, path: str, body: dict[str, Any], field: str | None
) -> None:
    async with serve(make_settings()) as s:
        response = await s.client.post(path, json={"model": GPT, **body})
        assert response.status_code == 400
        error = json.loads(await response.get_data())["error"]
        name = field or "prompt_cache_key"
        if path == "/v1/messages":  # Anthropic's envelope: no param, the name in the message
            assert error["type"] == "invalid_request_error" and name in error["message"]
        else:
            assert error["param"] == name


def test_a_session_key_does_not_change_what_an_answer_says() -> None:
    """``prompt_cache_key`` and ``user`` are left out of the content's seed (agents Rule 1),
    as ``user`` always was: the same question in two sessions gets the same answer."""
    from inference_lab.api.agents import content_rng

    plain = {"model": GPT, "messages": PROMPT}
    keyed = {**plain, "prompt_cache_key": "k", "user": "alice"}
    assert content_rng(0, plain).random() == content_rng(0, keyed).random()


async def test_the_quick_refusal_asks_with_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 529 written where a request is read asks the ledger about the request the route
    would admit, its session included: under session_affinity the seat it looks at is its
    session's replica's (admission Rule 6). Fails if the quick path leaves the key out."""
    from inference_lab.runtime.model_runtime import ModelRuntime
    from inference_lab.serve.quick_refusal import quick_refusal
    from tests.test_serve_quick_refusal import chat, llama_full

    asked: list[Any] = []
    plain = ModelRuntime.refuse_nowait

    def refuse_nowait(self: ModelRuntime, spec: Any) -> Any:
        asked.append(spec)
        return plain(self, spec)

    monkeypatch.setattr(ModelRuntime, "refuse_nowait", refuse_nowait)
    with trio.fail_after(30):
        async with llama_full(()) as (_port, state):
            body = json.dumps(chat(user="alice")).encode()
            headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
            reply = quick_refusal(state, "/v1/chat/completions", headers, None, body)
    assert reply is not None and reply.status == 529
    assert [spec.session for spec in asked] == [session_key("alice")]


async def test_the_openai_sdks_prompt_cache_key_keeps_a_session_on_its_replica() -> None:
    """The official client's ``prompt_cache_key`` on a real socket: the resend of a long
    prompt under the same key finds it cached (its session's replica), under another key
    the router sends elsewhere it does not."""
    import openai

    from tests.serve_util import running_server

    seed = first_seed()
    a, b = apart(seed)
    with trio.fail_after(30):
        async with running_server(settings_with(seed)) as (url, _, _state):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            cached = []
            for key in (a, a, b):
                answer = await client.chat.completions.create(
                    model=LLAMA, messages=PROMPT, max_tokens=4, prompt_cache_key=key
                )
                assert answer.usage is not None and answer.usage.prompt_tokens_details
                cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
            await client.close()
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
