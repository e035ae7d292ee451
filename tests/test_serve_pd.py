"""Prefill/decode hand-offs in ``serve`` (``--role``; ``serve/kv_transfer.py``,
``serve/kv_holds.py``, ``serve/kv_pulls.py``), in memory on the virtual clock: a prefill
server's held KV and its answer's ``kv_transfer_params``, releases and expiry, a decode
server's claim, priced transfer and release, and every refusal in the OpenAI envelope.

The decode server reaches the prefill server through :class:`AppPeers`, the side channel
in memory (the real one, over sockets, is ``tests/test_pd_proxy.py``'s). Llama-3.1-8B on
H100 (block size 16, 131,072 B of KV per position; the NIC 50 GB/s and 20 us); a chat of
``"hello " * 100`` counts 159 prompt tokens: 10 blocks, 144 positions sent.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from inference_lab.api.kv_transfer import FIELD, RemotePrefill
from inference_lab.core.roofline import Roofline
from inference_lab.errors import ApiError, ConfigError
from inference_lab.serve import ServeSettings, load_settings
from inference_lab.serve.kv_holds import KVHolds
from inference_lab.serve.kv_pulls import KVPulls
from inference_lab.serve.kv_transfer import KVRequest
from inference_lab.serve.transport import PeerAnswer, PeerUnavailable
from tests.conftest import LLAMA, Served, ServeFactory, chat_body, make_settings
from tests.test_serve_metrics import scrape, value

PROMPT = "hello " * 100
PROMPT_TOKENS = 159
BLOCKS = 10
SENT_POSITIONS = 144
BYTES_PER_POSITION = 131_072
NIC = (50e9, 2e-5)
PREFILL_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


def pd_settings(role: str, **settings: Any) -> ServeSettings:
    scheduler = settings.pop("scheduler", {})
    base = make_settings(LLAMA, hardware="h100", **scheduler)
    return attrs.evolve(base, role=role, **settings)


def prefill_body(**extra: Any) -> dict[str, Any]:
    body = chat_body(PROMPT, max_tokens=1, model=LLAMA, stream=False)
    body[FIELD] = dict(PREFILL_ASK)
    body.update(extra)
    return body


class AppPeers:
    """A decode server's side channel in memory: every peer is the prefill app; ``down``
    makes every call fail as an unreachable peer does."""

    def __init__(self, prefill: Served) -> None:
        self.prefill = prefill
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.down = False

    async def post(
        self, host: str, port: int, path: str, body: bytes, headers: list[tuple[str, str]]
    ) -> PeerAnswer:
        self.calls.append((path, json.loads(body)))
        if self.down:
            raise PeerUnavailable(f"cannot connect to {host}:{port}: Connection refused")
        response = await self.prefill.client.post(
            path, data=body, headers={"content-type": "application/json", **dict(headers)}
        )
        return PeerAnswer(response.status_code, await response.get_data())


def pulls(d: Served) -> KVPulls:
    assert d.state.kv.pulls is not None
    return d.state.kv.pulls


def holds(p: Served) -> KVHolds:
    assert p.state.kv.holds is not None
    return p.state.kv.holds


@asynccontextmanager
async def pd_pair(
    serve: ServeFactory, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
) -> AsyncIterator[tuple[Served, Served, AppPeers]]:
    """A prefill app and a decode app whose side channel reaches it."""
    async with (
        serve(pd_settings("prefill", **(prefill or {}))) as p,
        serve(pd_settings("decode", **(decode or {}))) as d,
    ):
        peers = AppPeers(p)
        pulls(d).peers = peers
        yield p, d, peers


async def prefill(p: Served, **extra: Any) -> dict[str, Any]:
    """The prefill answer's ``kv_transfer_params`` (asked on a connection whose server
    address is 127.0.0.1:8080, which the params name)."""
    async with p.stream(prefill_body(**extra)) as stream:
        await stream.read_all()
    assert stream.status == 200, stream.body_bytes()
    params: dict[str, Any] = json.loads(stream.body_bytes())[FIELD]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 8080)
    return params


def claim_of(params: dict[str, Any], **change: Any) -> dict[str, Any]:
    """The claim a decode server makes of the prefill answer's ``params``, with
    ``change`` over it."""
    claim = {
        "remote_engine_id": params["remote_engine_id"],
        "remote_request_id": params["remote_request_id"],
        "remote_block_ids": params["remote_block_ids"],
        "model": LLAMA,
        "prompt_tokens": PROMPT_TOKENS,
    }
    return {**claim, **change}


async def settle() -> None:
    """Let the engine tasks take what the HTTP side queued (a release)."""
    await trio.testing.wait_all_tasks_blocked()


def held_blocks(s: Served) -> tuple[int, int]:
    stats = s.runtime(LLAMA).engine.statistics()
    return stats.kv_used_blocks, sum(w.held for w in stats.workers)


# -- the prefill server ------------------------------------------------------------------


async def test_a_prefill_answer_carries_the_params_and_holds_the_kv(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """``do_remote_decode``: one token, then the answer's ``kv_transfer_params`` in vLLM's
    NixlConnector fields: this server's engine id, the request, one block id per block
    the 159-token prompt fills (10), the host and port it came in on, tp; the engine holds
    those 10 blocks; ``/metrics`` counts the hold."""
    async with serve(pd_settings("prefill", kv_engine_id="engine-p")) as p:
        response = await p.post("/v1/chat/completions", prefill_body())
        answer = json.loads(await response.get_data())
        assert answer["usage"]["prompt_tokens"] == PROMPT_TOKENS
        assert answer["usage"]["completion_tokens"] == 1
        params = answer[FIELD]
        assert list(params) == [
            "do_remote_prefill",
            "do_remote_decode",
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "remote_num_tokens",
        ]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == "engine-p"
        assert params["remote_request_id"] == answer["id"]
        assert params["remote_block_ids"] == list(range(1, BLOCKS + 1))
        assert params["remote_host"] == "127.0.0.1" and params["tp_size"] == 1
        assert params["remote_num_tokens"] == PROMPT_TOKENS
        assert held_blocks(p) == (BLOCKS, 1)
        _, samples = await scrape(p)
        assert value(samples, "inference_lab:kv_held_requests", LLAMA) == 1
        assert value(samples, "inference_lab:kv_holds_total", LLAMA) == 1
        # the next hold's block ids are new numbers
        second = await prefill(p)
        assert second["remote_block_ids"] == list(range(BLOCKS + 1, 2 * BLOCKS + 1))


async def test_a_release_gives_the_blocks_back_once(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """``POST /kv_transfer/release`` ends the hold: the engine's blocks go back; a second
    release of the same KV is a 404 in the envelope."""
    async with serve(pd_settings("prefill")) as p:
        params = await prefill(p)
        release = {k: params[k] for k in ("remote_engine_id", "remote_request_id")}
        response = await p.post("/kv_transfer/release", release)
        assert response.status_code == 200
        await settle()
        assert held_blocks(p) == (0, 0)
        again = await p.post("/kv_transfer/release", release)
        assert again.status_code == 404
        error = json.loads(await again.get_data())["error"]
        assert error["code"] == "kv_not_found" and "already pulled" in error["message"]
        _, samples = await scrape(p)
        assert value(samples, "inference_lab:kv_holds_ended_total", LLAMA, reason="released") == 1


async def test_held_kv_expires_after_the_timeout(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``: KV nobody pulls is held for
    ``kv_hold_timeout`` seconds after its request finished, then given back and counted."""
    async with serve(pd_settings("prefill", kv_hold_timeout=30.0)) as p:
        await prefill(p)
        finished = trio.current_time()
        await trio.sleep_until(finished + 29.9)
        assert held_blocks(p) == (BLOCKS, 1)
        await trio.sleep_until(finished + 30.0)
        await settle()
        assert held_blocks(p) == (0, 0)
        _, samples = await scrape(p)
        assert value(samples, "inference_lab:kv_holds_ended_total", LLAMA, reason="expired") == 1
        assert value(samples, "inference_lab:kv_held_requests", LLAMA) == 0


@pytest.mark.parametrize(
    ("change", "status", "words", "counted"),
    [
        ({"remote_engine_id": "another"}, 404, "is held elsewhere", True),
        ({"remote_request_id": "chatcmpl-unknown"}, 404, "no KV is held", True),
        ({"remote_block_ids": list(range(2, BLOCKS + 2))}, 404, "not those held", True),
        ({"prompt_tokens": PROMPT_TOKENS + 1}, 400, "-token prompt", True),
        ({"model": "another-model"}, 400, "'Llama-3.1-8B-Instruct''s, not", False),
        ({"remote_block_ids": 5}, 400, "remote_block_ids must be", False),
        ({"extra": 1}, 400, "unknown field 'extra'", False),
    ],
)
async def test_a_claim_on_kv_not_held_as_named_is_refused(
    serve: ServeFactory,
    autojump_clock: trio.testing.MockClock,
    change: dict[str, Any],
    status: int,
    words: str,
    counted: bool,
) -> None:
    """A claim names this engine, a held request, exactly its block ids, its model and its
    prompt's length; anything else is refused in the envelope (and counted under a served
    model's name once the body is well formed), and the hold stays claimable."""
    async with serve(pd_settings("prefill")) as p:
        params = await prefill(p)
        claim = claim_of(params)
        response = await p.post("/kv_transfer/claim", claim_of(params, **change))
        assert response.status_code == status
        assert words in json.loads(await response.get_data())["error"]["message"]
        ok = await p.post("/kv_transfer/claim", claim)
        assert ok.status_code == 200
        twice = await p.post("/kv_transfer/claim", claim)
        assert twice.status_code == 404  # claimed once only
        counts = holds(p).counts[LLAMA]
        assert (counts.claims, counts.claims_refused) == (1, 2 if counted else 1)


async def test_roles_serve_only_their_own_params(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A prefill server refuses ``do_remote_prefill`` and a decode server
    ``do_remote_decode``, naming the role; a server of role ``both`` ignores the field
    (today's server); every role serves a request without it."""
    decode_ask = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_block_ids": list(range(1, BLOCKS + 1)),
        "remote_host": "127.0.0.1",
        "remote_port": 9,
    }
    for role, params, flag in (
        ("prefill", decode_ask, "do_remote_prefill"),
        ("decode", PREFILL_ASK, "do_remote_decode"),
    ):
        async with serve(pd_settings(role)) as s:
            response = await s.post("/v1/chat/completions", prefill_body(**{FIELD: params}))
            assert response.status_code == 400
            error = json.loads(await response.get_data())["error"]
            assert error["param"] == f"{FIELD}.{flag}" and f"role is {role}" in error["message"]
            plain = await s.post("/v1/chat/completions", chat_body(model=LLAMA))
            assert plain.status_code == 200
    async with serve(pd_settings("both")) as s:
        response = await s.post("/v1/chat/completions", prefill_body())
        assert response.status_code == 200
        assert FIELD not in json.loads(await response.get_data())
        assert held_blocks(s) == (0, 0)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"stream": True}, "stream"),
        ("/v1/chat/completions", {"n": 2}, "n"),
        ("/v1/chat/completions", {FIELD: {"do_remote_decode": "yes"}}, f"{FIELD}.do_remote_decode"),
        (
            "/v1/chat/completions",
            {FIELD: {"do_remote_decode": True, "do_remote_prefill": True}},
            f"{FIELD}.do_remote_prefill",
        ),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ],
)
async def test_a_prefill_request_outside_the_protocol_is_a_400(
    serve: ServeFactory,
    autojump_clock: trio.testing.MockClock,
    path: str,
    extra: dict[str, Any],
    param: str,
) -> None:
    """A hand-off is of one non-streamed sequence of one prompt, with boolean flags."""
    async with serve(pd_settings("prefill")) as p:
        body = prefill_body(**extra)
        if path == "/v1/completions":
            body.pop("messages")
        response = await p.post(path, body)
        assert response.status_code == 400
        assert json.loads(await response.get_data())["error"]["param"] == param
        assert held_blocks(p) == (0, 0)


async def test_an_answer_never_delivered_ends_its_hold() -> None:
    """A hold whose answer did not reach its client ends at once (nobody can name it)."""

    class Runtime:
        name = LLAMA
        released: list[int] = []

        def release_kv(self, request_id: int) -> bool:
            self.released.append(request_id)
            return True

    from inference_lab.core.engine import Finished

    store = KVHolds("e", 480.0, lambda model: None, {LLAMA: 16})
    runtime: Any = Runtime()
    connector: Any = attrs.make_class("C", {"holds": attrs.field(), "pulls": attrs.field()})(
        store, None
    )
    from inference_lab.api.kv_transfer import RemoteDecode

    kv = KVRequest(connector, RemoteDecode())
    finished = Finished(
        request_id=7,
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=1,
        finish_reason="length",
        arrival_time=0.0,
        first_scheduled_time=0.0,
        first_token_time=0.1,
        finish_time=0.1,
        preemptions=0,
    )
    kv.hold = store.hold(runtime, finished, "req-1")
    kv.close()
    assert runtime.released == [7]
    assert store.counts[LLAMA].ended["undelivered"] == 1
    kv.close()  # idempotent
    assert runtime.released == [7]


# -- the decode server -------------------------------------------------------------------


async def test_a_decode_request_pulls_the_kv_then_releases_it(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The whole hand-off: the decode server claims the KV, is admitted with 144 remote
    positions, waits RECEIVING for 144 x 131,072 B / 50 GB/s + 20 us while the prefill
    still holds its blocks, then computes the other 15 positions and emits its first
    token at the end of that step; the prefill's blocks are released when the KV
    arrived, before that token. Nothing is held on either side afterwards."""
    async with pd_pair(serve) as (p, d, peers):
        params = await prefill(p)
        body = chat_body(PROMPT, max_tokens=4, model=LLAMA, stream=True)
        body[FIELD] = params
        start = trio.current_time()
        async with d.stream(body) as stream:
            await trio.testing.wait_all_tasks_blocked()
            stats = d.runtime(LLAMA).engine.statistics()
            assert stats.workers[0].receiving == 1
            assert held_blocks(p) == (BLOCKS, 1)  # the prefill holds until the KV arrived
            opening = await stream.next_chunk()  # the role frame, with the response's start
            assert opening is not None and b'"role":"assistant"' in opening
            first = await stream.next_chunk()
            assert first is not None and b'"content"' in first
            first_at = trio.current_time()
            assert held_blocks(p) == (0, 0)
            await stream.read_all()
        assert stream.status == 200 and stream.frames()[-1] == b"[DONE]"
        bandwidth, latency = NIC
        sent = SENT_POSITIONS * BYTES_PER_POSITION
        stats = d.runtime(LLAMA).engine.statistics()
        assert (stats.transfers, stats.transfer_bytes) == (1, sent)
        rf = Roofline(d.runtime(LLAMA).deployment)
        step = rf.price(rf.batch_terms([PROMPT_TOKENS - SENT_POSITIONS], [SENT_POSITIONS]))
        assert first_at - start == pytest.approx(latency + sent / bandwidth + step.seconds)
        assert [path for path, _ in peers.calls] == ["/kv_transfer/claim", "/kv_transfer/release"]
        assert held_blocks(d) == (0, 0) and held_blocks(p) == (0, 0)
        _, samples = await scrape(d)
        assert value(samples, "inference_lab:kv_transfers_total", LLAMA) == 1
        assert value(samples, "inference_lab:kv_transfer_bytes_total", LLAMA) == sent
        assert value(samples, "inference_lab:kv_pulls_total", LLAMA, outcome="claimed") == 1
        assert value(samples, "inference_lab:kv_pull_releases_total", LLAMA, outcome="sent") == 1


async def test_stale_params_are_refused_with_the_prefills_reason(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Params whose KV was pulled already (or expired) are refused by the decode server
    with the prefill server's 404, naming it; the request was never admitted."""
    async with pd_pair(serve) as (p, d, _):
        params = await prefill(p)
        body = chat_body(PROMPT, max_tokens=4, model=LLAMA, **{FIELD: params})
        assert (await d.post("/v1/chat/completions", body)).status_code == 200
        await settle()
        stale = await d.post("/v1/chat/completions", body)
        assert stale.status_code == 404
        error = json.loads(await stale.get_data())["error"]
        assert error["code"] == "kv_not_found" and error["param"] == FIELD
        assert "the prefill server at 127.0.0.1" in error["message"]
        assert "already pulled" in error["message"]
        assert d.runtime(LLAMA).snapshot().admitted == 1


@pytest.mark.parametrize(
    ("change", "status", "param", "contacted"),
    [
        ({"remote_host": "10.0.0.7"}, 400, f"{FIELD}.remote_host", False),
        ({"remote_block_ids": [1, 2]}, 400, f"{FIELD}.remote_block_ids", False),
        ({"remote_port": 0}, 400, f"{FIELD}.remote_port", False),
        ({"remote_request_id": None}, 400, f"{FIELD}.remote_request_id", False),
        ({"remote_engine_id": "another"}, 404, FIELD, True),
    ],
)
async def test_malformed_or_foreign_params_are_refused(
    serve: ServeFactory,
    autojump_clock: trio.testing.MockClock,
    change: dict[str, Any],
    status: int,
    param: str,
    contacted: bool,
) -> None:
    """Malformed params, another prompt's block count or a host that is not a peer (Rule 1
    of ``kv_pulls``: no connection is made) are 400s; another engine's id is the prefill
    server's 404. Nothing is admitted or held on the decode side."""
    async with pd_pair(serve) as (p, d, peers):
        params = {**(await prefill(p)), **change}
        body = chat_body(PROMPT, max_tokens=4, model=LLAMA, **{FIELD: params})
        response = await d.post("/v1/chat/completions", body)
        assert response.status_code == status
        assert json.loads(await response.get_data())["error"]["param"] == param
        assert bool(peers.calls) == contacted
        assert held_blocks(d) == (0, 0) and d.runtime(LLAMA).snapshot().admitted == 0
        assert held_blocks(p) == (BLOCKS, 1)  # still claimable by the right request


async def test_an_unreachable_prefill_server_is_a_503(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A prefill server that cannot be reached: 503 ``kv_transfer_unavailable``."""
    async with pd_pair(serve) as (p, d, peers):
        params = await prefill(p)
        peers.down = True
        body = chat_body(PROMPT, max_tokens=4, model=LLAMA, **{FIELD: params})
        response = await d.post("/v1/chat/completions", body)
        assert response.status_code == 503
        error = json.loads(await response.get_data())["error"]
        assert (
            error["code"] == "kv_transfer_unavailable" and "Connection refused" in error["message"]
        )
        counts = pulls(d).counts[LLAMA]
        assert (counts.claims, counts.claims_refused) == (0, 1)


async def test_a_decode_server_that_refuses_after_the_claim_releases_it(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A decode server full (``max_waiting`` 1, one seat) refuses the hand-off with 529
    after its claim: the claim is released, so the prefill's blocks go back (as vLLM's
    decode side frees a refused request's remote blocks)."""
    decode = {"scheduler": {"max_num_seqs": 1, "max_waiting": 1}}
    async with pd_pair(serve, decode=decode) as (p, d, _):
        async with d.stream(chat_body(model=LLAMA, max_tokens=200, stream=True)):
            async with d.stream(chat_body(model=LLAMA, max_tokens=200, stream=True)):
                await trio.testing.wait_all_tasks_blocked()
                assert d.runtime(LLAMA).snapshot().depth == 1
                params = await prefill(p)
                body = chat_body(PROMPT, max_tokens=4, model=LLAMA, **{FIELD: params})
                response = await d.post("/v1/chat/completions", body)
                assert response.status_code == 529
                await settle()
                assert held_blocks(p) == (0, 0)
                probe = await d.client.get(f"/kv_transfer/admission?model={LLAMA}")
                assert probe.status_code == 529 and "retry-after" in probe.headers
        await settle()
        probe = await d.client.get(f"/kv_transfer/admission?model={LLAMA}")
        assert probe.status_code == 200
        assert json.loads(await probe.get_data())["admits"] is True


async def test_a_decode_client_that_leaves_while_receiving_leaks_nothing(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A client that leaves during the transfer: the decode request is aborted, its
    blocks freed, and its claim released (the prefill's blocks go back)."""
    async with pd_pair(serve) as (p, d, peers):
        params = await prefill(p)
        body = chat_body(PROMPT, max_tokens=4, model=LLAMA, stream=True, **{FIELD: params})
        async with d.stream(body):
            await trio.testing.wait_all_tasks_blocked()
            assert d.runtime(LLAMA).engine.statistics().workers[0].receiving == 1
        await settle()
        assert held_blocks(d) == (0, 0) and held_blocks(p) == (0, 0)
        assert peers.calls[-1][0] == "/kv_transfer/release"
        assert d.runtime(LLAMA).snapshot().aborted == 1


async def test_a_short_prompt_sends_nothing_and_releases_at_once(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A prompt within one block has no full block to send: the decode request computes
    it all, no transfer is priced, and the claim is released at admission."""
    async with pd_pair(serve) as (p, d, peers):
        params = await prefill(p, messages=[{"role": "user", "content": "hi"}])
        assert len(params["remote_block_ids"]) == 1
        body = chat_body("hi", max_tokens=3, model=LLAMA, **{FIELD: params})
        answer = await d.post("/v1/chat/completions", body)
        assert answer.status_code == 200
        await settle()
        assert d.runtime(LLAMA).engine.statistics().transfers == 0
        assert held_blocks(p) == (0, 0)
        assert [path for path, _ in peers.calls] == ["/kv_transfer/claim", "/kv_transfer/release"]


async def test_the_admission_probe_answers_as_admission_would(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """``GET /kv_transfer/admission``: 200 while a request would be admitted, 400 without
    a model, 404 for an unknown one, 503 once the engine stopped."""
    async with serve(pd_settings("decode")) as d:
        ok = await d.client.get(f"/kv_transfer/admission?model={LLAMA}")
        assert ok.status_code == 200
        assert (await d.client.get("/kv_transfer/admission")).status_code == 400
        unknown = await d.client.get("/kv_transfer/admission?model=nope")
        assert unknown.status_code == 404
        d.runtime(LLAMA).stop()
        await settle()
        stopped = await d.client.get(f"/kv_transfer/admission?model={LLAMA}")
        assert stopped.status_code == 503
        # the claim routes belong to a prefill server
        assert (await d.post("/kv_transfer/claim", {})).status_code == 404


async def test_a_reasoning_models_hand_off_goes_the_agent_path(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A chat that asks gpt-oss-20b to reason is served by the agent path
    (``serve_chat_agent``): its prefill holds the KV and answers the params, its decode
    pulls them, answers with reasoning, and releases them."""
    from tests.conftest import GPT

    def gpt(role: str) -> ServeSettings:
        return attrs.evolve(make_settings(GPT), role=role)

    async with serve(gpt("prefill")) as p, serve(gpt("decode")) as d:
        peers = AppPeers(p)
        pulls(d).peers = peers
        effort = {"reasoning_effort": "medium"}
        body = chat_body(PROMPT, max_tokens=1, stream=False, **effort, **{FIELD: dict(PREFILL_ASK)})
        async with p.stream(body) as stream:
            await stream.read_all()
        params = json.loads(stream.body_bytes())[FIELD]
        assert p.runtime(GPT).engine.statistics().workers[0].held == 1
        answer = await d.post(
            "/v1/chat/completions", chat_body(PROMPT, max_tokens=40, **effort, **{FIELD: params})
        )
        assert answer.status_code == 200, await answer.get_data()
        message = json.loads(await answer.get_data())["choices"][0]["message"]
        assert message.get("reasoning")
        await settle()
        assert d.runtime(GPT).engine.statistics().transfers == 1
        assert p.runtime(GPT).engine.statistics().kv_used_blocks == 0
        assert [path for path, _ in peers.calls] == ["/kv_transfer/claim", "/kv_transfer/release"]


class NoPeers:
    """A side channel that must not be used: the peer check comes before any call."""

    async def post(
        self, host: str, port: int, path: str, body: bytes, headers: list[tuple[str, str]]
    ) -> PeerAnswer:
        raise AssertionError(f"contacted {host}:{port}")


@pytest.mark.parametrize(
    ("allowed", "host", "admitted"),
    [
        ((), "127.0.0.1", True),
        ((), "10.0.0.7", False),
        (("10.0.0.0/8",), "10.1.2.3", True),
        (("10.0.0.0/8",), "11.0.0.1", False),
        (("10.0.0.0/8",), "prefill-0.pool", False),
        (("fd00::/8",), "[fd00::7]", True),
        (("fd00::/8",), "10.1.2.3", False),
        (("prefill-0.pool", "192.168.1.0/24"), "PREFILL-0.pool", True),
        (("*",), "203.0.113.9", True),
    ],
)
def test_a_decode_server_pulls_only_from_its_peers(
    allowed: tuple[str, ...], host: str, admitted: bool
) -> None:
    """``kv_pulls`` Rule 1: loopback, a host named in ``--kv-peers``, an address inside a
    network named there, or any with ``*``; anything else is a 400 naming the field
    before a connection is made."""
    pulls = KVPulls(NoPeers(), allowed=allowed, api_key=None)
    params = RemotePrefill(engine_id="e", request_id="r", block_ids=(1,), host=host, port=80)
    if admitted:
        pulls.check_peer(params)
        return
    with pytest.raises(ApiError) as refused:
        pulls.check_peer(params)
    assert (refused.value.status, refused.value.param) == (400, f"{FIELD}.remote_host")


@pytest.mark.parametrize(
    ("peers", "expected"),
    [
        ("10.0.0.0/8, prefill-0.pool", ("10.0.0.0/8", "prefill-0.pool")),
        ("fd00::/8", ("fd00::/8",)),
        ("10.0.0.0/33", "kv_peers: '10.0.0.0/33' is not a network"),
        ("a b", "kv_peers: 'a b' is not a host name or address"),
        (" , ", "kv_peers: no host given"),
    ],
)
def test_kv_peers_are_hosts_networks_or_a_one_line_error(
    peers: str, expected: tuple[str, ...] | str
) -> None:
    """``--kv-peers`` takes host names, addresses and networks; anything else is one line
    naming the setting."""
    if isinstance(expected, tuple):
        settings = load_settings(config="Llama-3.1-8B-Instruct", role="decode", kv_peers=peers)
        assert settings.kv_peers == expected
        return
    with pytest.raises(ConfigError, match=expected):
        load_settings(config="Llama-3.1-8B-Instruct", role="decode", kv_peers=peers)
