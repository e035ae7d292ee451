"""Hostile inputs: the control plane and CORS, WebSocket upgrades, query arguments, the API
key's reach, start-up warnings, echoes, and an orphaned hypercorn worker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from inference_lab.serve import ServeSettings
from inference_lab.serve.gate import OPEN_PATHS
from inference_lab.serve.settings import startup_warnings
from tests.conftest import GPT, ServeFactory, chat_body, make_settings

ROOT = Path(__file__).resolve().parent.parent
ORIGIN = "https://evil.example"
TOKEN = "s3cret-token"
KEY = "sk-test-key"


def with_(settings: ServeSettings, **changes: Any) -> ServeSettings:
    return attrs.evolve(settings, **changes)


def envelope(data: bytes) -> dict[str, Any]:
    body = json.loads(data)
    assert list(body) == ["error"]
    error: dict[str, Any] = body["error"]
    return error


# -- CORS and the control plane ----------------------------------------------------------


async def test_cors_star_never_opens_the_control_plane_without_a_token(
    serve: ServeFactory,
) -> None:
    """With ``--allowed-origins '*'`` and no control token, /control/* answers no CORS
    header and no preflight (a page in a local browser is a loopback client); the API
    routes do."""
    async with serve(with_(make_settings(), allowed_origins=("*",))) as s:
        origin = {"origin": ORIGIN}
        response = await s.client.get("/control/capacity", headers=origin)
        assert response.status_code == 200  # a loopback client: answered ...
        assert "access-control-allow-origin" not in response.headers  # ... but not to pages
        preflight = {**origin, "access-control-request-method": "POST"}
        response = await s.client.options("/control/capacity", headers=preflight)
        assert "access-control-allow-origin" not in response.headers
        assert response.status_code != 200
        response = await s.client.get("/v1/models", headers=origin)
        assert response.headers["access-control-allow-origin"] == "*"
        response = await s.client.options("/v1/chat/completions", headers=preflight)
        assert response.status_code == 200


async def test_with_a_control_token_the_control_plane_answers_cors(serve: ServeFactory) -> None:
    settings = with_(make_settings(), allowed_origins=("*",), control_token=TOKEN)
    async with serve(settings) as s:
        headers = {"origin": ORIGIN, "authorization": f"Bearer {TOKEN}"}
        response = await s.client.get("/control/capacity", headers=headers)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "*"


def test_startup_warns_for_cors_star_with_the_control_plane_or_the_harness() -> None:
    base = make_settings()
    assert startup_warnings(base, "127.0.0.1") == []
    assert startup_warnings(with_(base, allowed_origins=("*",)), "127.0.0.1") == []
    [line] = startup_warnings(with_(base, allowed_origins=("*",), control_token=TOKEN))
    assert "/control/*" in line
    [line] = startup_warnings(with_(base, allowed_origins=("*",), enable_test_harness=True))
    assert "inject faults" in line


def test_startup_warns_for_a_public_address_without_a_key() -> None:
    """``--host 0.0.0.0`` without an API key says who may use the server; with the
    harness on it says so too; loopback hosts never warn."""
    base = make_settings()
    for host in ("127.0.0.1", "::1", "localhost"):
        assert startup_warnings(base, host) == []
    [line] = startup_warnings(base, "0.0.0.0")
    assert "without --api-key" in line and "--control-token" in line
    assert startup_warnings(with_(base, api_key=KEY), "0.0.0.0") == []
    lines = startup_warnings(with_(base, api_key=KEY, enable_test_harness=True), "::")
    assert len(lines) == 1 and "test harness" in lines[0]


def test_the_cli_prints_the_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """``inference-lab serve --host 0.0.0.0`` prints the warning before serving (the
    server is stopped at once by a bind failure raised after it)."""
    from inference_lab.serve import cli as serve_cli

    printed: list[str] = []

    def fake_bind(host: str, port: int, backlog: int) -> socket.socket:
        raise OSError(98, "Address in use")

    monkeypatch.setattr(serve_cli, "bind_socket", fake_bind)
    monkeypatch.setattr(
        serve_cli, "print", lambda *a, **k: printed.append(" ".join(map(str, a))), raising=False
    )
    import argparse

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--host", "0.0.0.0", "--config", str(ROOT / "configs" / "gpt-oss-20b.toml")]
    )
    serve_cli.run(args)
    assert not any("warning" in line for line in printed)  # the bind failed first
    monkeypatch.setattr(serve_cli, "bind_socket", lambda *a: socket.socket())
    monkeypatch.setattr(serve_cli.trio, "run", lambda *a, **k: None)
    serve_cli.run(args)
    assert any("warning: listening on 0.0.0.0 without --api-key" in line for line in printed)


# -- the API key's reach -----------------------------------------------------------------


async def test_the_api_key_guards_tokenize_and_detokenize(serve: ServeFactory) -> None:
    """Every route but the open paths (health, version, metrics and the probes ping and
    load) and the control plane needs the key: /tokenize and /detokenize are API routes."""
    assert frozenset({"/health", "/version", "/metrics", "/ping", "/load"}) == OPEN_PATHS
    async with serve(with_(make_settings(), api_key=KEY)) as s:
        good = {"authorization": f"Bearer {KEY}"}
        tokenize = {"model": GPT, "prompt": "hi"}
        response = await s.post("/tokenize", tokenize)
        assert response.status_code == 401
        assert envelope(await response.get_data())["code"] == "invalid_api_key"
        response = await s.client.post("/tokenize", json=tokenize, headers=good)
        assert response.status_code == 200
        detokenize = {"model": GPT, "tokens": json.loads(await response.get_data())["tokens"]}
        response = await s.post("/detokenize", detokenize)
        assert response.status_code == 401
        response = await s.client.post("/detokenize", json=detokenize, headers=good)
        assert response.status_code == 200
        for path in OPEN_PATHS:
            assert (await s.client.get(path)).status_code == 200, path


# -- query arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("value", ["\u00b2", "9" * 5000, "-1", "1e3", "12345678901", " 7"])
async def test_stats_count_arguments_are_ascii_digits_in_bounds(
    serve: ServeFactory, value: str
) -> None:
    """``?last=`` that is not a plain count (a superscript digit, 5,000 digits, a sign, an
    exponent, too large) is a 400 naming the parameter, with the value cut."""
    async with serve() as s:
        response = await s.client.get("/control/stats", query_string={"last": value})
        assert response.status_code == 400
        error = envelope(await response.get_data())
        assert (error["code"], error["param"]) == ("invalid_value", "last")
        assert len(error["message"]) < 400
        response = await s.client.get("/control/stats", query_string={"last": "10"})
        assert response.status_code == 200


# -- echoes --------------------------------------------------------------------------------


async def test_a_huge_preflight_header_list_is_not_echoed(serve: ServeFactory) -> None:
    async with serve(with_(make_settings(), allowed_origins=(ORIGIN,))) as s:
        asked = ", ".join(f"x-h{i}" for i in range(2000))
        headers = {
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": asked,
        }
        response = await s.client.options("/v1/chat/completions", headers=headers)
        assert response.status_code == 200
        allowed = response.headers["access-control-allow-headers"]
        assert len(allowed) < 256 and "authorization" in allowed
        short = {**headers, "access-control-request-headers": "content-type, x-foo"}
        response = await s.client.options("/v1/chat/completions", headers=short)
        assert response.headers["access-control-allow-headers"] == "content-type, x-foo"


# -- WebSocket upgrades ------------------------------------------------------------------


async def test_a_websocket_upgrade_is_a_404_envelope_over_a_real_socket(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """hypercorn hands an upgrade to the app as a WebSocket: the app answers 404 in the
    OpenAI envelope on any path, logs nothing, and the server keeps serving."""
    from inference_lab.serve import create_app
    from inference_lab.serve.server import bind_socket, serve_app

    app = create_app(make_settings())
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            sock = bind_socket("127.0.0.1", 0)
            port = sock.getsockname()[1]
            await nursery.start(serve_app, app, sock)
            for path in ("/v1/chat/completions", "/nope", "/control/stats"):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(
                    (
                        f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\n"
                        "connection: upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                        "sec-websocket-version: 13\r\n\r\n"
                    ).encode()
                )
                data = b""
                while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    data += chunk
                await stream.aclose()
                head, _, body = data.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 404"), head
                if b"transfer-encoding: chunked" in head.lower():
                    body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
                error = envelope(body.strip())
                assert error["code"] == "not_found" and "WebSocket" in error["message"]
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
            await stream.aclose()
            nursery.cancel_scope.cancel()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


# -- an orphaned hypercorn worker ----------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        out.extend(int(c) for c in children)
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
async def test_a_plain_hypercorn_worker_exits_when_its_parent_is_killed() -> None:
    """``kill -9`` of hypercorn's parent process: its worker ends too and the port is
    free for a restart (no orphan holding it: ``Errno 98``)."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_LAB_")}
    env.update(INFERENCE_LAB_CONFIG="configs/gpt-oss-20b.toml", PYTHONUNBUFFERED="1")
    with trio.fail_after(60):
        proc = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "hypercorn",
                "--worker-class",
                "trio",
                "-b",
                f"127.0.0.1:{port}",
                "inference_lab.serve:create_app()",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        workers: list[int] = []
        try:
            while True:  # serving: the worker answers
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    await trio.sleep(0.1)
                    continue
                await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                answer = await stream.receive_some(4096)
                await stream.aclose()
                if answer.startswith(b"HTTP/1.1 200"):
                    break
            workers = _children(proc.pid)
            assert workers, "hypercorn spawned no worker"
            proc.kill()
            await proc.wait()
            for worker in workers:
                try:
                    fd = os.pidfd_open(worker)
                except ProcessLookupError:
                    continue  # gone already
                try:
                    await trio.lowlevel.wait_readable(fd)  # readable once it has exited
                finally:
                    os.close(fd)
            again = socket.socket()
            again.bind(("127.0.0.1", port))  # the port is free
            again.close()
        finally:
            if proc.returncode is None:
                proc.kill()
            for worker in workers:
                try:
                    os.kill(worker, signal.SIGKILL)
                except ProcessLookupError:
                    pass


async def test_chat_still_works(serve: ServeFactory) -> None:
    """A plain request after the checks above (the gate still lets the API through)."""
    async with serve() as s:
        response = await s.post("/v1/chat/completions", chat_body())
        assert response.status_code == 200


# -- out of file descriptors -------------------------------------------------------------------


def test_the_accept_filter_keeps_one_short_line_a_second() -> None:
    """trio's "accept returned EMFILE" error with its traceback, ten times a second,
    becomes one line without a traceback per second, saying how many it dropped; other
    records pass untouched."""
    import logging

    from inference_lab.serve.transport.accept_log import AcceptCapacityFilter

    now = [0.0]
    f = AcceptCapacityFilter(every=1.0, clock=lambda: now[0])

    def record(msg: str, *args: object) -> logging.LogRecord:
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            import sys as _sys

            info = _sys.exc_info()
        return logging.LogRecord("trio.serve_listeners", logging.ERROR, "x", 1, msg, args, info)

    kept = []
    for tick in range(25):  # 2.5 s of retries every 0.1 s
        now[0] = tick / 10
        r = record("accept returned %s (%s); retrying in %s seconds", "EMFILE", "x", 0.1)
        if f.filter(r):
            kept.append(r)
    assert len(kept) == 3
    assert all(r.exc_info is None and r.levelname == "WARNING" for r in kept)
    assert "EMFILE" in kept[0].getMessage() and "repeats" not in kept[0].getMessage()
    assert "(9 repeats not logged)" in kept[1].getMessage()
    other = record("something else")
    assert f.filter(other) and other.exc_info is not None


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_NOFILE and /proc are Linux's here")
async def test_a_server_out_of_descriptors_logs_quietly_and_accepts_again() -> None:
    """A real server limited to 128 descriptors, sent 200 idle connections: its log holds
    no traceback and at most a line a second about it, and once the connections close it
    answers again."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_LAB_")}
    env["PYTHONUNBUFFERED"] = "1"
    with trio.fail_after(90):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "inference_lab.cli", "serve", "--port", "0",
             "--config", "configs/gpt-oss-20b.toml"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=limit,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        out = b""
        while b"listening on" not in out:
            chunk = await proc.stdout.receive_some(4096)
            assert chunk, "the server ended before it served"
            out += chunk
        port = int(out.split(b"listening on http://127.0.0.1:")[1].split()[0])
        held: list[trio.SocketStream] = []
        try:
            for _ in range(200):
                try:
                    held.append(await trio.open_tcp_stream("127.0.0.1", port))
                except OSError:
                    break
            await trio.sleep(3.0)  # the accept loop retries meanwhile
            for stream in held:
                await stream.aclose()
            held.clear()
            answered = False
            for _ in range(50):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(
                    b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                )
                with trio.move_on_after(2):
                    answered = (await stream.receive_some(4096)).startswith(b"HTTP/1.1 200")
                await stream.aclose()
                if answered:
                    break
            assert answered
        finally:
            for stream in held:
                await stream.aclose()
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        err = b""
        while chunk := await proc.stderr.receive_some(65536):
            err += chunk
    text = err.decode(errors="replace")
    lines = [line for line in text.splitlines() if "cannot accept connections" in line]
    assert "Traceback" not in text and "accept returned" not in text
    assert 1 <= len(lines) <= 6, text[-2000:]
