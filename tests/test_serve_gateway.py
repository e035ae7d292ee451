"""The surface gateways, proxies and browsers rely on: ``x-request-id`` on every answer,
``GET /v1/models/{id}``, ``max_model_len``, ``GET /version``, the API key and CORS."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from typing import Any

import attrs
import openai
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from inference_lab.errors import ConfigError
from inference_lab.serve import ServeSettings, create_app, load_settings, settings_from_env
from inference_lab.serve import cli as serve_cli
from inference_lab.serve.gate import MAX_REQUEST_ID
from tests.conftest import CONFIGS, GPT, LLAMA, ServeFactory, Stream, chat_body, make_settings
from tests.serve_util import serving

KEY = "sk-lab-test-key"
ORIGIN = "http://localhost:3000"


def with_(settings: ServeSettings, **changes: Any) -> ServeSettings:
    return attrs.evolve(settings, **changes)


def error_of(data: bytes) -> dict[str, Any]:
    body = json.loads(data)
    assert list(body) == ["error"]
    error: dict[str, Any] = body["error"]
    return error


# -- x-request-id --------------------------------------------------------------------------


async def test_completion_request_id_is_the_body_id(serve: ServeFactory) -> None:
    """Without a client id, a completion's x-request-id is the id in its body."""
    async with serve() as s:
        response = await s.post("/v1/chat/completions", chat_body())
        body = json.loads(await response.get_data())
        assert response.status_code == 200
        assert body["id"].startswith("chatcmpl-")
        assert response.headers["x-request-id"] == body["id"]
        response = await s.post("/v1/completions", {"model": GPT, "prompt": "hi", "max_tokens": 2})
        body = json.loads(await response.get_data())
        assert body["id"].startswith("cmpl-")
        assert response.headers["x-request-id"] == body["id"]


async def test_stream_request_id_is_every_chunks_id(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s, s.stream(chat_body(max_tokens=3, stream=True)) as st:
        await st.read_all()
    ids = {json.loads(f)["id"] for f in st.frames() if f != b"[DONE]"}
    assert len(ids) == 1
    assert st.headers["x-request-id"] == ids.pop()


async def test_client_request_id_is_echoed_on_every_kind_of_answer(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A usable client id comes back unchanged on a completion (whose body keeps the
    server's id), a stream, an error, a refusal, a Quart 404, /health and /metrics."""
    rid = {"x-request-id": "trace-7f3a:b/c d=e"}
    async with serve(make_settings(max_num_seqs=1, max_waiting=1)) as s:
        response = await s.client.post("/v1/chat/completions", json=chat_body(), headers=rid)
        assert response.headers["x-request-id"] == rid["x-request-id"]
        assert json.loads(await response.get_data())["id"].startswith("chatcmpl-")
        bad = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=0), headers=rid)
        assert bad.status_code == 400 and bad.headers["x-request-id"] == rid["x-request-id"]
        for path in ("/health", "/metrics", "/v1/models", "/no/such/route"):
            response = await s.client.get(path, headers=rid)
            assert response.headers["x-request-id"] == rid["x-request-id"], path
        # a stream and a 529 refusal
        async with trio.open_nursery() as nursery:
            running = _stream(s.app, chat_body(max_tokens=30, stream=True), rid)
            running.start(nursery)
            while not running.token_times():
                assert await running.next_chunk() is not None
            queued = _stream(s.app, chat_body(max_tokens=2, stream=True), rid)
            queued.start(nursery)
            await trio.testing.wait_all_tasks_blocked()
            refused = await s.client.post("/v1/chat/completions", json=chat_body(), headers=rid)
            assert refused.status_code == 529
            assert refused.headers["x-request-id"] == rid["x-request-id"]
            await running.read_all()
            await queued.read_all()
        assert running.headers["x-request-id"] == rid["x-request-id"]


def _stream(app: Any, body: dict[str, Any], headers: dict[str, str] | dict[str, bytes]) -> Stream:
    """A request on the in-memory connection with extra headers (values as given, raw
    bytes included)."""
    stream = Stream(app, "/v1/chat/completions", json.dumps(body).encode())
    stream.scope["headers"].extend(
        (k.encode(), v if isinstance(v, bytes) else v.encode()) for k, v in headers.items()
    )
    return stream


@pytest.mark.parametrize(
    "sent",
    [b"x" * (MAX_REQUEST_ID + 1), "caf\u00e9".encode(), b"tab\there", b"bell\x07", b""],
    ids=repr,
)
async def test_unusable_client_request_id_is_replaced(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock, sent: bytes
) -> None:
    """Longer than MAX_REQUEST_ID, non-ASCII, unprintable or empty: the server's id."""
    async with serve() as s, trio.open_nursery() as nursery:
        st = _stream(s.app, chat_body(), {"x-request-id": sent})
        st.start(nursery)
        await st.read_all()
    assert st.status == 200
    assert st.headers["x-request-id"] == json.loads(st.body_bytes())["id"]


async def test_a_request_id_of_the_maximum_length_is_kept(serve: ServeFactory) -> None:
    rid = "r" * MAX_REQUEST_ID
    async with serve() as s:
        response = await s.client.get("/health", headers={"x-request-id": rid})
    assert response.headers["x-request-id"] == rid


async def test_other_routes_get_a_fresh_id_per_request(serve: ServeFactory) -> None:
    async with serve() as s:
        ids = [(await s.client.get("/health")).headers["x-request-id"] for _ in range(3)]
        missing = await s.client.get("/nope")
    assert len(set(ids)) == 3 and all(i.startswith("req-") for i in ids)
    assert missing.status_code == 404 and missing.headers["x-request-id"].startswith("req-")


# -- models, version -----------------------------------------------------------------------


async def test_models_carry_max_model_len(serve: ServeFactory) -> None:
    settings = make_settings(GPT, LLAMA)
    async with serve(settings) as s:
        status, body = await s.get_json("/v1/models")
    assert status == 200
    expected = {d.model.name: d.model.max_seq_len for d in settings.deployments}
    assert {m["id"]: m["max_model_len"] for m in body["data"]} == expected


async def test_retrieve_a_model_by_id(serve: ServeFactory) -> None:
    """``GET /v1/models/{id}`` answers the same object as the list does."""
    async with serve(make_settings(GPT, LLAMA)) as s:
        _, listing = await s.get_json("/v1/models")
        for entry in listing["data"]:
            status, body = await s.get_json(f"/v1/models/{entry['id']}")
            assert status == 200
            assert body == entry


async def test_retrieve_a_model_whose_id_has_slashes(serve: ServeFactory) -> None:
    (dep,) = make_settings().deployments
    named = attrs.evolve(dep, model=attrs.evolve(dep.model, name="openai/gpt-oss-20b"))
    async with serve(ServeSettings(deployments=(named,))) as s:
        status, body = await s.get_json("/v1/models/openai/gpt-oss-20b")
        assert (status, body["id"]) == (200, "openai/gpt-oss-20b")
        status, body = await s.get_json("/v1/models/openai")
        assert status == 404


async def test_retrieve_an_unknown_model_is_the_404_envelope(serve: ServeFactory) -> None:
    async with serve() as s:
        response = await s.client.get("/v1/models/nope")
        error = error_of(await response.get_data())
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert (error["code"], error["param"], error["type"]) == (
        "model_not_found",
        "model",
        "invalid_request_error",
    )
    assert error["message"].startswith("Model 'nope' not found")


async def test_version_is_the_package_version(serve: ServeFactory) -> None:
    async with serve() as s:
        status, body = await s.get_json("/version")
    assert status == 200
    assert body == {"version": importlib.metadata.version("inference-lab")}


# -- API key -------------------------------------------------------------------------------


async def test_api_key_guards_v1_only(serve: ServeFactory) -> None:
    """With an API key every /v1/* request needs ``Authorization: Bearer <key>`` (401
    ``invalid_api_key`` envelope otherwise, before the body is read); health, version
    and metrics stay open."""
    async with serve(with_(make_settings(), api_key=KEY)) as s:
        for path in ("/v1/models", f"/v1/models/{GPT}"):
            response = await s.client.get(path)
            assert response.status_code == 401, path
        missing = await s.post("/v1/chat/completions", chat_body())
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        error = error_of(await missing.get_data())
        assert (error["code"], error["type"], error["param"]) == (
            "invalid_api_key",
            "invalid_request_error",
            None,
        )
        assert "didn't provide an API key" in error["message"]
        for wrong in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}", KEY):
            response = await s.client.post(
                "/v1/chat/completions", json=chat_body(), headers={"authorization": wrong}
            )
            assert response.status_code == 401, wrong
            assert KEY not in (await response.get_data()).decode()
        good = {"authorization": f"Bearer {KEY}"}
        response = await s.client.post("/v1/chat/completions", json=chat_body(), headers=good)
        assert response.status_code == 200
        response = await s.client.get("/v1/models", headers={"authorization": f"bearer  {KEY} "})
        assert response.status_code == 200
        for path in ("/health", "/version", "/metrics"):
            assert (await s.client.get(path)).status_code == 200, path
        assert s.runtime().snapshot().admitted == 1


async def test_without_an_api_key_v1_is_open(serve: ServeFactory) -> None:
    async with serve() as s:
        response = await s.client.get("/v1/models", headers={"authorization": "Bearer whatever"})
    assert response.status_code == 200


def test_api_key_and_origins_load_from_flags_and_environment() -> None:
    config = str(CONFIGS / "gpt-oss-20b.toml")
    settings = load_settings(config=config, api_key=KEY, allowed_origins=f"{ORIGIN}, *")
    assert (settings.api_key, settings.allowed_origins) == (KEY, (ORIGIN, "*"))
    assert KEY not in repr(settings)
    env = {
        "INFERENCE_LAB_CONFIG": config,
        "INFERENCE_LAB_API_KEY": KEY,
        "INFERENCE_LAB_ALLOWED_ORIGINS": "HTTPS://App.Example.com:8443,http://[::1]:5173",
    }
    settings = settings_from_env(env)
    assert settings.api_key == KEY
    assert settings.allowed_origins == ("https://app.example.com:8443", "http://[::1]:5173")
    settings = settings_from_env({"INFERENCE_LAB_CONFIG": config})
    assert (settings.api_key, settings.allowed_origins) == (None, ())


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"api_key": "has space"}, "api_key: must be"),
        ({"api_key": ""}, "api_key: is empty"),
        ({"allowed_origins": "localhost:3000"}, "'localhost:3000' is not an origin"),
        ({"allowed_origins": "http://a.example/app"}, "is not an origin"),
        ({"allowed_origins": " , "}, "no origin given"),
    ],
)
def test_bad_api_key_or_origins_are_config_errors(changes: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_settings(config=CONFIGS / "gpt-oss-20b.toml", **changes)  # type: ignore[arg-type]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_cli_flags_reach_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """``--api-key`` / ``--allowed-origins`` parse, and a bad origin is a one-line startup
    error (exit 1) naming the flag."""
    args = _args("--api-key", KEY, "--allowed-origins", ORIGIN)
    assert (args.api_key, args.allowed_origins) == (KEY, ORIGIN)
    assert _args().api_key is None and _args().allowed_origins is None
    config = str(CONFIGS / "gpt-oss-20b.toml")
    assert serve_cli.run(_args("--config", config, "--allowed-origins", "nope")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --allowed-origins: 'nope' is not an origin" in err[0]


# -- CORS ------------------------------------------------------------------------------------

PREFLIGHT = {
    "origin": ORIGIN,
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type, x-stainless-os",
}


async def test_no_cors_by_default(serve: ServeFactory) -> None:
    """Without --allowed-origins nothing answers CORS: no preflight, no headers."""
    async with serve() as s:
        preflight = await s.client.options("/v1/chat/completions", headers=PREFLIGHT)
        response = await s.client.get("/v1/models", headers={"origin": ORIGIN})
    assert preflight.status_code != 200
    for r in (preflight, response):
        assert not any(k.lower().startswith("access-control-") for k in r.headers.keys())


async def test_preflight_is_answered_for_listed_origins_only(serve: ServeFactory) -> None:
    """A listed origin's preflight is a 200 with the allowed methods, the asked headers,
    a max age and the origin echoed (even with an API key: preflights carry none); an
    unlisted origin's gets no CORS header."""
    settings = with_(make_settings(), allowed_origins=(ORIGIN,), api_key=KEY)
    async with serve(settings) as s:
        ok = await s.client.options("/v1/chat/completions", headers=PREFLIGHT)
        other = await s.client.options(
            "/v1/chat/completions", headers={**PREFLIGHT, "origin": "http://evil.example"}
        )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert ok.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"
    assert ok.headers["access-control-allow-headers"] == PREFLIGHT["access-control-request-headers"]
    assert ok.headers["access-control-max-age"] == "600"
    assert ok.headers["vary"] == "origin"
    assert "x-request-id" in ok.headers
    assert other.status_code == 401  # not a preflight to this server: the API key answers
    assert "access-control-allow-origin" not in other.headers


async def test_listed_origin_gets_cors_headers_on_every_answer(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Completions (plain and streamed), Quart routes and errors carry the allow-origin,
    expose the request id and Retry-After to the page, and vary on Origin."""
    async with serve(with_(make_settings(), allowed_origins=(ORIGIN,))) as s:
        origin = {"origin": ORIGIN}
        answers = [
            await s.client.post("/v1/chat/completions", json=chat_body(), headers=origin),
            await s.client.get("/v1/models", headers=origin),
            await s.client.get("/v1/models/nope", headers=origin),
        ]
        async with trio.open_nursery() as nursery:
            st = _stream(s.app, chat_body(max_tokens=2, stream=True), origin)
            st.start(nursery)
            await st.read_all()
        other = await s.client.get("/v1/models", headers={"origin": "http://other.example"})
    for r in answers:
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["vary"] == "origin"
        exposed = r.headers["access-control-expose-headers"]
        assert "x-request-id" in exposed and "retry-after" in exposed
    assert st.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in other.headers


async def test_wildcard_origin_allows_any(serve: ServeFactory) -> None:
    async with serve(with_(make_settings(), allowed_origins=("*",))) as s:
        response = await s.client.get("/v1/models", headers={"origin": "http://any.example"})
        preflight = await s.client.options("/v1/models", headers=PREFLIGHT)
    assert response.headers["access-control-allow-origin"] == "*"
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"


async def test_gateway_surface_serves_two_models(serve: ServeFactory) -> None:
    """The per-model routes address each model by its own id."""
    async with serve(make_settings(GPT, LLAMA)) as s:
        for model in (GPT, LLAMA):
            status, body = await s.get_json(f"/v1/models/{model}")
            assert (status, body["id"]) == (200, model)


# -- the real server with the official client ------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")
async def test_openai_client_behind_an_api_key_sees_request_ids_and_retrieves_models() -> None:
    """Over a real socket: the SDK's ``_request_id`` is the completion's id, a wrong key is
    the SDK's AuthenticationError, ``models.retrieve`` answers with ``max_model_len``, and
    /metrics (no key) counts the completion's tokens."""
    settings = with_(make_settings(), api_key=KEY)
    app = create_app(settings)
    with trio.fail_after(20):
        async with serving(app) as port:
            url = f"http://127.0.0.1:{port}"
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            completion = await client.chat.completions.create(
                model=GPT, messages=[{"role": "user", "content": "hello world"}], max_tokens=3
            )
            assert completion._request_id == completion.id
            model = await client.models.retrieve(GPT)
            assert model.id == GPT
            assert (model.model_extra or {})["max_model_len"] == (
                settings.deployments[0].model.max_seq_len
            )
            wrong = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
            await client.close()
            await wrong.close()
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(
                b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
            )
            raw = bytearray()
            while chunk := await stream.receive_some(65536):
                raw += chunk
            await stream.aclose()
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    samples = {
        (s.name, s.labels.get("finished_reason")): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("vllm:generation_tokens_total", None)] == 3
    assert samples[("vllm:request_success_total", "length")] == 1
