"""Hostile and careless clients (issue 9): every bad input is a clear JSON error and never a
5xx; request paths are matched as sent; POST bodies are declared JSON; the control plane
needs a token (or a loopback client naming a loopback host); a slow or oversized body is
refused early; a shutdown ends every live request with a complete answer naming it.

In-memory tests use the Quart test client or :class:`BodyFeed` (a raw ASGI exchange whose
body the test sends piece by piece), with the autojump clock where time matters; the
socket tests run on ``127.0.0.1:0`` under ``trio.fail_after``, never with that clock.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from werkzeug.exceptions import NotFound

from inference_lab.errors import ConfigError
from inference_lab.serve import create_app, get_state, settings_from_env
from inference_lab.serve.cli import add_parser
from inference_lab.serve.completions import MAX_BODY_PIECES, BodyTimeout, read_body
from inference_lab.serve.server import DEFAULT_BACKLOG
from tests.conftest import CONFIG_FILES, GPT, ROOT, ServeFactory, chat_body, make_settings
from tests.serve_util import serving

JSON_HEADERS = {"content-type": "application/json"}
POST_PATHS = ("/v1/chat/completions", "/v1/completions", "/control/capacity")
LIMIT = 2 * 1024 * 1024


def error_of(status: int, data: bytes, expected_status: int, code: str) -> dict[str, Any]:
    """The envelope's ``error`` after checking the status and the code."""
    assert status == expected_status, data[:300]
    body = json.loads(data)
    assert list(body) == ["error"], body
    error: dict[str, Any] = body["error"]
    assert error["code"] == code, error
    return error


async def post_raw(s: Any, path: str, data: bytes, **headers: str) -> tuple[int, Any, bytes]:
    response = await s.client.post(path, data=data, headers={**JSON_HEADERS, **headers})
    return response.status_code, response.headers, await response.get_data()


def assert_idle(state: Any) -> None:
    """No queue slot, batch slot, pending slot or KV block is held by any model."""
    for rt in state.runtimes.values():
        snap, st = rt.snapshot(), rt.engine.statistics()
        assert (snap.running, snap.depth, st.kv_used_blocks, st.running) == (0, 0, 0, 0)


# -- item 1, 2, 6: bad JSON and echoed values ------------------------------------------------


@pytest.mark.parametrize("path", POST_PATHS)
async def test_deeply_nested_json_is_a_400_on_every_post_endpoint(
    serve: ServeFactory, path: str
) -> None:
    """A body nested past the decoder's recursion limit is a 400 invalid_json, not a 500."""
    async with serve() as s:
        for depth in (1000, 100_000):
            status, _, data = await post_raw(s, path, b"[" * depth + b"]" * depth)
            error_of(status, data, 400, "invalid_json")
            nested = b'{"model":' * depth + b"1" + b"}" * depth
            status, _, data = await post_raw(s, path, nested)
            error_of(status, data, 400, "invalid_json")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            b'{"model":"gpt-oss-20b","messages":[{"role":"user","content":"a\\ud800b"}]}',
            "messages",
        ),
        ("/v1/chat/completions", b'{"model":"\\ud800","messages":[]}', "model"),
        ("/v1/completions", b'{"model":"gpt-oss-20b","prompt":"\\udfff"}', "prompt"),
        ("/v1/completions", b'{"model":"x\\udbff","prompt":"hi"}', "model"),
        ("/control/capacity", b'{"model":"\\ud800","max_num_seqs":2}', "model"),
    ],
)
async def test_lone_surrogates_are_a_400_naming_the_field(
    serve: ServeFactory, path: str, body: bytes, param: str
) -> None:
    """A lone surrogate escape anywhere is refused as a 400 whose body encodes (neither
    the tokenizer nor a 404 body may fail to encode it); nothing changed."""
    async with serve() as s:
        status, _, data = await post_raw(s, path, body)
        assert status == 400, data
        error = json.loads(data)["error"]
        assert error["param"] is not None and error["param"].startswith(param), error
        _, capacity = await s.get_json("/control/capacity")
        assert capacity[0]["max_num_seqs"] == 256


@pytest.mark.parametrize("path", POST_PATHS[:2])
@pytest.mark.parametrize("model", [[GPT], {"name": GPT}, 7, None, True])
async def test_a_model_that_is_not_a_string_is_a_400(
    serve: ServeFactory, path: str, model: Any
) -> None:
    """Found by the fuzz suite: a list ``model`` was looked up as a dict key (500)."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "prompt": "x"}
    async with serve() as s:
        status, _, data = await post_raw(s, path, json.dumps(body).encode())
        error = error_of(status, data, 400, "invalid_value")
        assert error["param"] == "model"


async def test_a_megabyte_model_name_gets_a_bounded_404(serve: ServeFactory) -> None:
    async with serve() as s:
        body = json.dumps(chat_body(model="m" * 1_000_000)).encode()
        status, _, data = await post_raw(s, "/v1/chat/completions", body)
        error = error_of(status, data, 404, "model_not_found")
        assert len(data) < 2_000 and GPT in error["message"]
        body = json.dumps({"model": "m" * 1_000_000, "max_waiting": 3}).encode()
        status, _, data = await post_raw(s, "/control/capacity", body)
        error_of(status, data, 404, "model_not_found")
        assert len(data) < 2_000


@pytest.mark.parametrize("field", ["max_num_seqs", "max_waiting"])
async def test_absurd_capacity_values_are_a_400_and_change_nothing(
    serve: ServeFactory, field: str
) -> None:
    async with serve() as s:
        for value in (10**29, 2**63, 10**7):
            body = json.dumps({field: value}).encode()
            status, _, data = await post_raw(s, "/control/capacity", body)
            error = error_of(status, data, 400, "invalid_value")
            assert error["param"] == field
        _, capacity = await s.get_json("/control/capacity")
        assert (capacity[0]["max_num_seqs"], capacity[0]["max_waiting"]) == (256, 0)


# -- item 6: paths are matched as sent ------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "//v1//chat//completions"),
        ("POST", "/v1//completions"),
        ("GET", "//v1//models"),
        ("GET", "//health"),
        ("POST", "//control//capacity"),
        ("GET", "/v1/models//"),
    ],
)
async def test_a_path_with_empty_segments_is_a_json_404_without_a_redirect(
    serve: ServeFactory, method: str, path: str
) -> None:
    """Werkzeug's slash merging answered 308 with an HTML body and a Location built from
    the client's Host; the path is now matched as sent."""
    async with serve() as s:
        response = await s.client.open(
            path, method=method, data=b"{}", headers={**JSON_HEADERS, "host": "evil.example"}
        )
        data = await response.get_data()
        error = error_of(response.status_code, data, 404, "not_found")
        assert error["message"] == f"No route for {method} {path}"
        assert "location" not in response.headers
        assert response.headers["content-type"] == "application/json"


async def test_the_quart_url_map_does_not_merge_slashes(serve: ServeFactory) -> None:
    """Second line of defence behind the gate: Quart's URL map never answers a path with
    empty segments with a redirect."""
    async with serve() as s:
        adapter = s.app.url_map.bind("evil.example")
        for path in ("//v1//models", "/v1//models", "/v1/models//x", "//control//stats"):
            with pytest.raises(NotFound):
                adapter.match(path, method="GET")


@pytest.mark.parametrize("host", [".", "a..b", "x" * 64 + ".example"])
@pytest.mark.parametrize(("method", "path"), [("GET", "/health"), ("POST", "/tokenize")])
async def test_a_host_werkzeug_cannot_bind_is_a_400_envelope(
    serve: ServeFactory, host: str, method: str, path: str
) -> None:
    """Found by the fuzz suite: ``Host: .`` made Werkzeug raise BadHost while Quart built
    the request context, before any error handler: a bare 500 and a traceback."""
    async with serve() as s:
        response = await s.client.open(
            path, method=method, json={"prompt": "x"}, headers={"host": host}
        )
        error = error_of(response.status_code, await response.get_data(), 400, "invalid_host")
        assert error["message"] == "The Host header is not a valid host name"


# -- item 5: POST bodies are declared JSON --------------------------------------------------


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "application/json-seq",
    ],
)
async def test_a_post_body_not_declared_json_is_a_415(
    serve: ServeFactory, path: str, content_type: str | None
) -> None:
    """The content types a browser may send without a CORS preflight (and an untyped
    body) are refused before the body is read; the capacity is unchanged."""
    body = json.dumps({"max_num_seqs": 3, **chat_body()}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    async with serve() as s:
        response = await s.client.post(path, data=body, headers=headers)
        data = await response.get_data()
        error = error_of(response.status_code, data, 415, "unsupported_media_type")
        assert "application/json" in error["message"]
        _, capacity = await s.get_json("/control/capacity")
        assert capacity[0]["max_num_seqs"] == 256
        assert s.runtime().snapshot().admitted == 0


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
async def test_json_content_types_with_parameters_are_accepted(
    serve: ServeFactory, content_type: str
) -> None:
    async with serve() as s:
        response = await s.client.post(
            "/control/capacity",
            data=b'{"max_num_seqs":3}',
            headers={"content-type": content_type},
        )
        assert response.status_code == 200
        response = await s.client.post(
            "/v1/completions",
            data=json.dumps({"model": GPT, "prompt": "hi", "max_tokens": 2}).encode(),
            headers={"content-type": content_type},
        )
        assert response.status_code == 200


# -- item 5: the control token --------------------------------------------------------------


async def test_the_control_token_is_required_on_control_endpoints(serve: ServeFactory) -> None:
    """With a control token: no credentials (or not Bearer) is a 401 with
    WWW-Authenticate, a wrong token a 403, the right one passes; other endpoints need none."""
    settings = attrs.evolve(make_settings(), control_token="s3cret-token")
    async with serve(settings) as s:
        cases = [
            ({}, 401, "missing_control_token"),
            ({"authorization": "Basic czNjcmV0LXRva2Vu"}, 401, "missing_control_token"),
            ({"authorization": "Bearer"}, 401, "missing_control_token"),
            ({"authorization": "Bearer s3cret-tokeN"}, 403, "control_forbidden"),
            ({"authorization": "Bearer s3cret-token-and-more"}, 403, "control_forbidden"),
        ]
        for headers, status, code in cases:
            for method, path in (("GET", "/control/capacity"), ("GET", "/control/stats")):
                response = await s.client.open(path, method=method, headers=headers)
                error_of(response.status_code, await response.get_data(), status, code)
                if status == 401:
                    assert response.headers["www-authenticate"] == 'Bearer realm="control"'
            response = await s.client.post(
                "/control/capacity", json={"max_num_seqs": 1}, headers=headers
            )
            assert response.status_code == status
        good = {"authorization": "Bearer s3cret-token"}
        response = await s.client.post("/control/capacity", json={"max_num_seqs": 5}, headers=good)
        assert response.status_code == 200
        response = await s.client.get(
            "/control/stats", headers={"authorization": "bearer s3cret-token"}
        )
        assert response.status_code == 200
        assert (await s.client.get("/health")).status_code == 200
        assert (
            await s.client.post(
                "/v1/completions", json={"model": GPT, "prompt": "x", "max_tokens": 1}
            )
        ).status_code == 200
        assert s.runtime().snapshot().max_num_seqs == 5


@pytest.mark.parametrize(
    ("host", "client", "allowed"),
    [
        ("localhost", None, True),
        ("127.0.0.1:8080", ("127.0.0.1", 5000), True),
        ("[::1]:8080", ("::1", 5000, 0, 0), True),
        ("LOCALHOST:1", ("127.0.0.2", 5000), True),
        ("evil.example", ("127.0.0.1", 5000), False),
        ("evil.example:8080", None, False),
        ("127.0.0.1.evil.example", None, False),
        ("localhost", ("10.0.0.5", 5000), False),
        ("10.0.0.1:8080", ("10.0.0.5", 5000), False),
    ],
)
async def test_without_a_token_the_control_plane_answers_loopback_only(
    serve: ServeFactory, host: str, client: tuple[Any, ...] | None, allowed: bool
) -> None:
    """No control token: a DNS-rebinding page (a foreign Host) or a remote client gets a
    403; a loopback client naming a loopback host is served."""
    scope_base = {"client": client} if client is not None else None
    async with serve() as s:
        response = await s.client.post(
            "/control/capacity",
            json={"max_num_seqs": 7},
            headers={"host": host},
            scope_base=scope_base,
        )
        data = await response.get_data()
        if allowed:
            assert response.status_code == 200, data
            assert s.runtime().snapshot().max_num_seqs == 7
        else:
            error_of(response.status_code, data, 403, "control_forbidden")
            assert s.runtime().snapshot().max_num_seqs == 256
        response = await s.client.get("/v1/models", headers={"host": host}, scope_base=scope_base)
        assert response.status_code == 200


# -- item 6: slow and oversized bodies --------------------------------------------------------


class BodyFeed:
    """One raw ASGI exchange with the app: the test sends the body piece by piece and
    sees the response messages as the app sends them."""

    def __init__(self, app: Any, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.app = app
        self.scope = {
            "type": "http",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"), *headers],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8080),
            "extensions": {},
            "state": {},
        }
        self.to_app, self._app_receive = trio.open_memory_channel[dict[str, Any]](math.inf)
        self._app_send, self.from_app = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.done = trio.Event()

    async def run(self) -> None:
        try:
            await self.app(self.scope, self._app_receive.receive, self._app_send.send)
        finally:
            self.done.set()

    def feed(self, data: bytes, more: bool = True) -> None:
        self.to_app.send_nowait({"type": "http.request", "body": data, "more_body": more})

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        start = await self.from_app.receive()
        assert start["type"] == "http.response.start"
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        body = b""
        while True:
            message = await self.from_app.receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                return start["status"], headers, body


@pytest.mark.parametrize("path", [*POST_PATHS, "/tokenize"])
async def test_a_slow_body_gets_a_408_at_the_configured_deadline(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock, path: str
) -> None:
    """A body still incomplete ``body_timeout`` seconds after the request arrived is a
    408 (Quart's own deadline was 60 s), on the raw completion routes and Quart's."""
    settings = attrs.evolve(make_settings(), body_timeout=2.5)
    async with serve(settings) as s, trio.open_nursery() as nursery:
        feed = BodyFeed(s.app, path, [])
        start = trio.current_time()
        nursery.start_soon(feed.run)
        feed.feed(b'{"model":')
        status, headers, body = await feed.response()
        assert trio.current_time() - start == pytest.approx(2.5, abs=0.01)
        error = error_of(status, body, 408, "request_timeout")
        assert "did not arrive" in error["message"]
        assert headers.get("connection") == "close" or path not in POST_PATHS[:2]
        await feed.done.wait()
        assert_idle(s.state)


@pytest.mark.parametrize("path", [*POST_PATHS, "/tokenize"])
@pytest.mark.parametrize("declared", [False, True])
async def test_a_body_is_refused_as_soon_as_it_passes_the_limit(
    serve: ServeFactory, path: str, declared: bool
) -> None:
    """413 as soon as the declared length, or the received bytes, pass 2 MiB: the app
    answers without waiting for the rest of the body (here: never sent)."""
    async with serve() as s, trio.open_nursery() as nursery:
        headers = [(b"content-length", str(LIMIT * 4).encode())] if declared else []
        feed = BodyFeed(s.app, path, headers)
        nursery.start_soon(feed.run)
        if not declared:
            for _ in range(8):
                feed.feed(b" " * (LIMIT // 8))
            feed.feed(b" ")  # one byte past the limit; more_body stays True
        with trio.fail_after(5):
            status, _, body = await feed.response()
        error_of(status, body, 413, "request_too_large")
        feed.to_app.send_nowait({"type": "http.disconnect"})


async def test_a_body_in_tiny_pieces_is_refused_after_max_body_pieces(
    serve: ServeFactory,
) -> None:
    """A body sent in 4-byte chunks, each a piece the stack pays CPU for, is refused once
    it passes MAX_BODY_PIECES pieces, the rest unread."""
    async with serve() as s, trio.open_nursery() as nursery:
        feed = BodyFeed(s.app, "/v1/chat/completions", [])
        nursery.start_soon(feed.run)
        for _ in range(MAX_BODY_PIECES + 1):
            feed.feed(b"    ")
        with trio.fail_after(10):
            status, headers, body = await feed.response()
        error_of(status, body, 413, "request_too_fragmented")
        assert headers["connection"] == "close"
        feed.to_app.send_nowait({"type": "http.disconnect"})


async def test_a_body_in_max_body_pieces_pieces_is_read(serve: ServeFactory) -> None:
    body = json.dumps(chat_body(max_tokens=2)).encode()
    pieces = [body[i : i + 1] for i in range(len(body))]
    pieces += [b" "] * (MAX_BODY_PIECES - len(pieces))
    async with serve() as s, trio.open_nursery() as nursery:
        feed = BodyFeed(s.app, "/v1/chat/completions", [])
        nursery.start_soon(feed.run)
        for piece in pieces[:-1]:
            feed.feed(piece)
        feed.feed(pieces[-1], more=False)
        with trio.fail_after(10):
            status, _, _ = await feed.response()
        assert status == 200


# -- item 4: draining -----------------------------------------------------------------------


async def test_a_draining_server_refuses_every_request_with_503_and_connection_close(
    serve: ServeFactory,
) -> None:
    async with serve() as s:
        s.state.draining = True
        for method, path in (("GET", "/health"), ("POST", "/v1/chat/completions")):
            response = await s.client.open(path, method=method, json=chat_body())
            error_of(response.status_code, await response.get_data(), 503, "server_shutting_down")
            assert response.headers["connection"] == "close"
        assert s.runtime().snapshot().admitted == 0


async def test_drain_lets_requests_finish_within_the_grace_period_then_ends_the_rest(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A request that finishes within the grace period ends normally; one still live when
    it ends gets an answer naming the shutdown: a stream its error frame and [DONE] in a
    complete body, a non-streaming request a 503. No slot or writer is held; drain
    returns at the end of the grace period."""
    async with serve() as s:
        state = s.state
        async with (
            s.stream(chat_body(max_tokens=20, stream=True)) as short,
            s.stream(chat_body(max_tokens=100_000, stream=True)) as long,
            s.stream(chat_body(max_tokens=100_000)) as plain,
        ):
            await short.next_chunk()
            await long.next_chunk()
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            ended = await state.drain(2.0)
            assert trio.current_time() - start == pytest.approx(2.0, abs=0.05)
            assert ended == 2
            await short.read_all()
            await long.read_all()
            await plain.read_all()
        frames = short.frames()
        assert frames[-1] == b"[DONE]"
        assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
        frames = long.frames()
        assert frames[-1] == b"[DONE]"
        error = json.loads(frames[-2])["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
        assert plain.status == 503
        assert json.loads(plain.body_bytes())["error"]["code"] == "server_shutting_down"
        assert plain.headers["connection"] == "close"
        await trio.testing.wait_all_tasks_blocked()
        # The engines are stopped (their state is frozen); no slot or writer is held.
        assert state.delivery.open == 0
        assert [(rt.snapshot().alive, rt.snapshot().depth) for rt in state.runtimes.values()] == [
            (False, 0)
        ]


async def test_drain_returns_at_once_when_nothing_is_live(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s:
        start = trio.current_time()
        assert await s.state.drain(30.0) == 0
        assert trio.current_time() == start


# -- settings and flags -----------------------------------------------------------------------


def test_hardening_settings_come_from_the_environment() -> None:
    env = {
        "INFERENCE_LAB_CONFIG": str(CONFIG_FILES[GPT]),
        "INFERENCE_LAB_CONTROL_TOKEN": "abc",
        "INFERENCE_LAB_BODY_TIMEOUT": "2.5",
    }
    settings = settings_from_env(env)
    assert (settings.control_token, settings.body_timeout) == ("abc", 2.5)
    assert "abc" not in repr(settings)
    plain = settings_from_env({"INFERENCE_LAB_CONFIG": str(CONFIG_FILES[GPT])})
    assert (plain.control_token, plain.body_timeout) == (None, 10.0)
    for name, value in (
        ("INFERENCE_LAB_BODY_TIMEOUT", "0"),
        ("INFERENCE_LAB_BODY_TIMEOUT", "nan"),
        ("INFERENCE_LAB_BODY_TIMEOUT", "soon"),
        ("INFERENCE_LAB_CONTROL_TOKEN", "has space"),
    ):
        with pytest.raises(ConfigError, match="(?i)" + name.removeprefix("INFERENCE_LAB_")):
            settings_from_env({**env, name: value})


def test_hardening_flags_parse_with_their_defaults() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert (args.backlog, args.control_token, args.body_timeout, args.shutdown_grace) == (
        DEFAULT_BACKLOG,
        None,
        10.0,
        3.0,
    )
    assert DEFAULT_BACKLOG >= 1024
    args = parser.parse_args(
        ["serve", "--backlog", "4096", "--control-token", "t", "--body-timeout", "0.5"]
    )
    assert (args.backlog, args.control_token, args.body_timeout) == (4096, "t", 0.5)


# -- real sockets ------------------------------------------------------------------------------


def _listen_backlog(port: int) -> int | None:
    """The backlog in force on a listening port (``ss``'s Send-Q), or None without ss."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    out = subprocess.run(
        [ss, "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[2])


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("ss") is None, reason="Linux ss")
async def test_the_backlog_asked_for_is_the_one_in_force() -> None:
    """hypercorn calls listen() again on the socket it adopts (with its default of 100
    before): the backlog given to bind_socket and serve_app is the one the kernel uses."""
    with trio.fail_after(20):
        for backlog in (1500, DEFAULT_BACKLOG):
            assert await _backlog_in_force(backlog) == backlog


async def _backlog_in_force(backlog: int) -> int | None:
    app = create_app(make_settings())
    async with serving(app, backlog=backlog) as port:
        return _listen_backlog(port)


async def _request(port: int, raw: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await stream.send_all(raw)
        data = bytearray()
        while chunk := await stream.receive_some(65536):
            data += chunk
        return bytes(data)
    finally:
        await stream.aclose()


def _post(path: str, body: bytes, *, close: bool = True) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
    )
    return (head + ("connection: close\r\n" if close else "") + "\r\n").encode() + body


def _get(path: str, extra: str = "") -> bytes:
    head = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n{extra}\r\n"
    return head.encode()


@pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")
async def test_a_burst_is_answered_at_once_admitting_exactly_the_bound() -> None:
    """300 simultaneous streams against max_num_seqs 4, max_waiting 16: exactly 20
    admitted, 280 byte-identical 529s, all answered within seconds; after the admitted
    clients leave, nothing is held."""
    settings = make_settings(max_num_seqs=4, max_waiting=16)
    app = create_app(settings)
    state = get_state(app)
    body = json.dumps(chat_body(max_tokens=100_000, stream=True)).encode()
    heads: list[bytes] = []
    with trio.fail_after(30):
        async with serving(app) as port:
            streams: list[trio.SocketStream] = []

            async def one() -> None:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                streams.append(stream)
                await stream.send_all(_post("/v1/chat/completions", body, close=False))
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await stream.receive_some(65536)
                heads.append(data)

            with trio.fail_after(10):
                async with trio.open_nursery() as burst:
                    for _ in range(300):
                        burst.start_soon(one)
            statuses = [h.split(b" ", 2)[1] for h in heads]
            assert statuses.count(b"200") == 20 and statuses.count(b"529") == 280
            refusals = {h.split(b"\r\n\r\n", 1)[1] for h in heads if b" 529 " in h[:13]}
            assert len(refusals) <= 2  # the body; or its head only, the rest still in flight
            for stream in streams:
                await stream.aclose()
            with trio.fail_after(5):
                while state.live_requests():  # noqa: ASYNC110 - the server's own tasks
                    await trio.sleep(0.01)
            assert_idle(state)


def _chunks(data: bytes) -> tuple[bytes, bool]:
    """The payload of a chunked body and whether it ended with its terminator."""
    payload, rest = b"", data
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return payload, rest == b"\r\n"
        payload += rest[:size]
        rest = rest[size + 2 :]
    return payload, False


@pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets and signals")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_ends_every_live_stream_with_a_complete_answer(
    signum: signal.Signals,
) -> None:
    """``inference-lab serve`` (control token from the environment, ``--backlog 1234``)
    with streams in flight gets a signal: a new request is a 503
    with Connection: close; a stream that ends within the grace period ends normally, every
    other one with the shutdown's error frame; each ends with [DONE] and the chunked
    terminator; a non-streaming request gets a 503; exit code 0, no traceback."""
    with trio.fail_after(40):
        proc = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "inference_lab.cli",
                "serve",
                "--port",
                "0",
                "--config",
                str(CONFIG_FILES[GPT]),
                "--shutdown-grace",
                "1",
                "--backlog",
                "1234",
            ],
            cwd=ROOT,
            env={**os.environ, "INFERENCE_LAB_CONTROL_TOKEN": "tok-123"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            seen = b""
            while not (match := re.search(rb"listening on http://127\.0\.0\.1:(\d+)", seen)):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, seen
                seen += chunk
            port = int(match.group(1))
            results: dict[str, bytes] = {}

            async def fetch(name: str, body: dict[str, Any], started: trio.Event) -> None:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(_post("/v1/chat/completions", json.dumps(body).encode()))
                data = await stream.receive_some(65536)
                started.set()
                while chunk := await stream.receive_some(65536):
                    data += chunk
                results[name] = data
                await stream.aclose()

            async with trio.open_nursery() as nursery:
                # (ignore_eos: each runs to its max_tokens, as vLLM's field asks)
                kinds = {
                    **{
                        f"short{i}": chat_body(max_tokens=30, stream=True, ignore_eos=True)
                        for i in range(3)
                    },
                    **{
                        f"long{i}": chat_body(max_tokens=100_000, stream=True, ignore_eos=True)
                        for i in range(5)
                    },
                }
                for name, body in kinds.items():
                    started = trio.Event()
                    nursery.start_soon(fetch, name, body, started)
                    await started.wait()
                plain = trio.Event()
                long_plain = chat_body(max_tokens=100_000, ignore_eos=True)
                nursery.start_soon(fetch, "plain", long_plain, plain)
                # The CLI's wiring: the token from the environment, the backlog flag.
                assert (await _request(port, _get("/control/stats"))).startswith(b"HTTP/1.1 401")
                if shutil.which("ss"):
                    assert _listen_backlog(port) == 1234
                stats = _get("/control/stats", "authorization: Bearer tok-123\r\n")
                while b'"admitted":9' not in await _request(port, stats):  # noqa: ASYNC110
                    await trio.sleep(0.02)  # another process: poll it
                proc.send_signal(signum)
                err = b""
                while b"shutting down" not in err:
                    err += await proc.stderr.receive_some(4096)
                refused = await _request(port, _post("/v1/models", b"{}"))
            assert refused.startswith(b"HTTP/1.1 503")
            assert b"connection: close" in refused.lower() and b"server_shutting_down" in refused
            for name, data in results.items():
                head, _, chunked = data.partition(b"\r\n\r\n")
                if name == "plain":
                    assert head.startswith(b"HTTP/1.1 503"), data[:200]
                    assert b"server_shutting_down" in chunked
                    continue
                assert head.startswith(b"HTTP/1.1 200"), data[:200]
                payload, terminated = _chunks(chunked)
                assert terminated, (name, data[-200:])
                events = payload.split(b"\n\n")
                assert events[-1] == b"" and events[-2] == b"data: [DONE]", (name, events[-3:])
                last = json.loads(events[-3].removeprefix(b"data: "))
                if name.startswith("short"):
                    assert last["choices"][0]["finish_reason"] == "length"
                else:
                    assert last["error"]["code"] == "server_shutting_down"
            code = await proc.wait()
            while chunk := await proc.stderr.receive_some(65536):
                err += chunk
            assert code == 0, err
            assert b"Traceback" not in err and b"stopped" in err
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")
async def test_a_trickled_body_on_a_real_socket_is_cut_at_the_deadline() -> None:
    """Over hypercorn: a body sent a byte at a time gets its 408 once the deadline has
    passed (the request's arrival, which came after the client began to send, plus the
    body timeout) and the connection is closed (no request is read from the rest of the
    body)."""
    settings = attrs.evolve(make_settings(), body_timeout=0.5)
    app = create_app(settings)
    with trio.fail_after(30):
        async with serving(app) as port:
            for path in ("/v1/chat/completions", "/control/capacity"):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                sent = trio.current_time()
                await stream.send_all(_post(path, b"x" * 100_000)[:-100_000] + b"{")
                data = b""
                while not data.endswith(b"}}"):
                    await stream.send_all(b" ")
                    data += await _receive_nowait(stream)
                    await trio.sleep(0.05)
                assert data.startswith(b"HTTP/1.1 408"), data[:200]
                assert trio.current_time() - sent >= 0.5  # not before the deadline
                await stream.aclose()


async def _receive_nowait(stream: trio.SocketStream) -> bytes:
    with trio.move_on_after(0.001):
        return await stream.receive_some(65536)
    return b""


def record_body_deadlines(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """From now on, the deadline of every ``trio.move_on_at`` scope entered, in order."""
    scopes: list[float] = []
    plain_move_on_at = trio.move_on_at

    def recording(deadline: float) -> trio.CancelScope:
        scopes.append(deadline)
        return plain_move_on_at(deadline)

    monkeypatch.setattr(trio, "move_on_at", recording)
    return scopes


async def test_only_a_wait_for_a_body_piece_is_bounded_by_the_deadline(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_body`` enters a cancel scope (the body's deadline) only when it has to wait
    for a piece: none for a body that came whole, one per wait otherwise, and the wait
    that passes the deadline raises ``BodyTimeout`` at the deadline."""
    scopes = record_body_deadlines(monkeypatch)
    scope: dict[str, Any] = {"headers": []}
    send, receive = trio.open_memory_channel[dict[str, Any]](8)
    whole = {"type": "http.request", "body": b"{}", "more_body": False}
    send.send_nowait(whole)
    deadline = trio.current_time() + 2.5
    assert await read_body(receive.receive, scope, deadline=deadline) == b"{}"
    assert scopes == []

    async def second_piece() -> None:
        await trio.sleep(1)
        send.send_nowait({"type": "http.request", "body": b"}", "more_body": False})

    send.send_nowait({"type": "http.request", "body": b"{", "more_body": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(second_piece)
        assert await read_body(receive.receive, scope, deadline=deadline) == b"{}"
    assert scopes == [deadline]

    send.send_nowait({"type": "http.request", "body": b"{", "more_body": True})
    with pytest.raises(BodyTimeout):
        await read_body(receive.receive, scope, deadline=deadline)
    assert trio.current_time() == pytest.approx(deadline)


async def test_a_body_whose_declared_length_arrived_is_whole(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hypercorn queues a body's bytes (``more_body`` true) and then, after a trip through
    the scheduler, an empty end-of-body message: once the declared length has arrived,
    ``read_body`` returns without waiting for that message; short of it, or with no
    declared length, it waits."""
    scopes = record_body_deadlines(monkeypatch)
    send, receive = trio.open_memory_channel[dict[str, Any]](8)
    start = trio.current_time()
    deadline = start + 2.5
    declared = {"headers": [(b"content-length", b"4")]}
    send.send_nowait({"type": "http.request", "body": b"{}  ", "more_body": True})
    assert await read_body(receive.receive, declared, deadline=deadline) == b"{}  "
    assert (trio.current_time(), scopes) == (start, [])
    for scope in (declared, {"headers": []}):
        send.send_nowait({"type": "http.request", "body": b"{}", "more_body": True})
        with pytest.raises(BodyTimeout):
            await read_body(receive.receive, scope, deadline=deadline)
    assert scopes == [deadline, deadline]
