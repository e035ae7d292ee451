"""A prefill server's side channel answered where it is read (``serve/kv_routes.py`` Rule
4, ``serve/asgi.py`` Rule 8, ``transport/quick.py``): ``POST /kv_transfer/claim`` and
``/kv_transfer/release`` read whole in one read are answered by the connection's own task
with the raw route's very reply (status, headers, body) and the same accounting; the same
calls split over two reads go the route's way. Real sockets on 127.0.0.1 under
``trio.fail_after``; nothing here reads a clock's value."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio

from inference_lab.api.kv_transfer import FIELD
from inference_lab.serve import asgi
from inference_lab.serve.kv_holds import KVHolds
from inference_lab.serve.state import ServeState
from tests.conftest import LLAMA, chat_body, make_settings
from tests.serve_util import running_server
from tests.test_serve_pd import PROMPT_TOKENS, claim_of
from tests.test_serve_quick_refusal import exchange as writes_answer
from tests.test_serve_quick_refusal import post as whole_post
from tests.transport_util import h11_answers

PROMPT = "hello " * 100  # 159 chat prompt tokens on Llama-3.1-8B: 10 blocks
REQUEST_ID = "x-request-id: side-channel-7"


def post(path: str, body: Any) -> tuple[bytes, bytes]:
    """A ``POST`` of ``body`` (JSON, or bytes as they are) as its head and its body."""
    head, _, payload = whole_post(path, body, REQUEST_ID).partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", payload


async def exchange(port: int, head: bytes, body: bytes, *, split: bool) -> bytes:
    """One answer to ``head + body`` on a new connection: in one write (the quick path's
    request), or the body in a second write after a pause (two reads: the route's)."""
    return await writes_answer(port, *((head, body) if split else (head + body,)))


def comparable(answer: bytes) -> tuple[int, dict[bytes, bytes], Any]:
    """Status, headers (but the date) and the JSON body of one whole answer."""
    ((status, headers, body),) = h11_answers(answer, 1)
    named = {bytes(k).lower(): bytes(v) for k, v in headers}
    named.pop(b"date", None)
    return status, named, json.loads(body)


def holds(state: ServeState) -> KVHolds:
    assert state.kv.holds is not None
    return state.kv.holds


async def held(port: int) -> dict[str, Any]:
    """Prefill one request for a decode server; its answer's ``kv_transfer_params``."""
    body = chat_body(PROMPT, max_tokens=1, model=LLAMA, stream=False)
    body[FIELD] = {"do_remote_decode": True, "do_remote_prefill": False}
    head, payload = post("/v1/chat/completions", body)
    status, _, answer = comparable(await exchange(port, head, payload, split=False))
    assert status == 200, answer
    params: dict[str, Any] = answer[FIELD]
    return params


def release_of(params: dict[str, Any]) -> dict[str, Any]:
    return {k: params[k] for k in ("remote_engine_id", "remote_request_id")}


def spy_quick_posts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """From now on, each ``POST`` the connection answers or leaves: its path and the quick
    answer's status (None: left to the route)."""
    seen: list[tuple[str, int | None]] = []
    plain = asgi.InferenceLabApp.quick_post

    def spy(self: Any, path: str, *args: Any) -> Any:
        reply = plain(self, path, *args)
        seen.append((path, None if reply is None else reply.status))
        return reply

    monkeypatch.setattr(asgi.InferenceLabApp, "quick_post", spy)
    return seen


async def test_claims_and_releases_are_answered_where_they_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kv_routes Rule 4: a claim and a release read whole are answered by the connection
    (the quick path answers them, nothing is left to the route); the same calls split
    over two reads are the route's, and both give the same status, headers and body (but
    the hold's own id) and move the hold's counters alike; a claim or release of KV that
    is not held is the same 404 envelope either way."""
    settings = attrs.evolve(make_settings(LLAMA, hardware="h100"), role="prefill")
    with trio.fail_after(30):
        async with running_server(settings) as (_, port, state):
            first, second = await held(port), await held(port)
            counts = holds(state).counts[LLAMA]
            seen = spy_quick_posts(monkeypatch)
            answers = {}
            for split, params in ((False, first), (True, second)):
                claimed = counts.claims
                head, body = post("/kv_transfer/claim", claim_of(params))
                answers["claim", split] = comparable(await exchange(port, head, body, split=split))
                assert counts.claims == claimed + 1
            quick_claims = list(seen)
            for split, params in ((False, first), (True, second)):
                head, body = post("/kv_transfer/release", release_of(params))
                answers["release", split] = comparable(
                    await exchange(port, head, body, split=split)
                )
            assert counts.ended["released"] == 2 and holds(state).held(LLAMA) == 0
            for split in (False, True):  # pulled already: the same refusal both ways
                refused = counts.claims_refused
                head, body = post("/kv_transfer/claim", claim_of(first))
                answers["claim gone", split] = comparable(
                    await exchange(port, head, body, split=split)
                )
                assert counts.claims_refused == refused + 1
                head, body = post("/kv_transfer/release", release_of(first))
                answers["release gone", split] = comparable(
                    await exchange(port, head, body, split=split)
                )
    assert quick_claims == [("/kv_transfer/claim", 200)]  # the split one was not offered
    for call, params in (("claim", (first, second)), ("release", (first, second))):
        (q_status, q_headers, q_body), (r_status, r_headers, r_body) = (
            answers[call, False],
            answers[call, True],
        )
        assert (q_status, q_headers) == (r_status, r_headers) and q_status == 200
        assert q_headers[b"x-request-id"] == b"side-channel-7"
        assert q_body["remote_request_id"] == params[0]["remote_request_id"]
        assert r_body["remote_request_id"] == params[1]["remote_request_id"]
        assert {**q_body, "remote_request_id": ""} == {**r_body, "remote_request_id": ""}
    assert answers["claim", False][2] == {
        "remote_request_id": first["remote_request_id"],
        "prompt_tokens": PROMPT_TOKENS,
        "blocks": 10,
    }
    for call in ("claim gone", "release gone"):
        assert answers[call, False] == answers[call, True]
        status, _, body = answers[call, False]
        assert status == 404 and body["error"]["code"] == "kv_not_found"
        assert "already pulled" in body["error"]["message"]


@pytest.mark.parametrize(
    ("role", "body", "status", "code"),
    [
        ("prefill", b"{not json", 400, "invalid_json"),
        ("prefill", json.dumps({"remote_engine_id": "e"}).encode(), 400, None),
        ("prefill", json.dumps({"extra": 1}).encode(), 400, None),
        ("decode", json.dumps({"remote_engine_id": "e"}).encode(), 404, "kv_not_found"),
        ("both", b"{}", 404, "kv_not_found"),
    ],
    ids=["bad-json", "missing-field", "unknown-field", "decode-role", "both-role"],
)
async def test_a_refused_side_channel_call_is_the_routes_refusal(
    monkeypatch: pytest.MonkeyPatch, role: str, body: bytes, status: int, code: str | None
) -> None:
    """kv_routes Rules 1-2 and 4: a body that is not JSON or not a claim, or a call on a
    server of another role, is refused where it is read with the route's envelope, byte
    for byte (but the date)."""
    settings = attrs.evolve(make_settings(LLAMA, hardware="h100"), role=role)
    with trio.fail_after(30):
        async with running_server(settings) as (_, port, _state):
            seen = spy_quick_posts(monkeypatch)
            head = post("/kv_transfer/claim", body)[0]
            quick = comparable(await exchange(port, head, body, split=False))
            routed = comparable(await exchange(port, head, body, split=True))
    assert seen == [("/kv_transfer/claim", status)]
    assert quick == routed
    assert quick[0] == status and "error" in quick[2]
    if code is not None:
        assert quick[2]["error"]["code"] == code
