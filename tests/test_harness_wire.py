"""The test harness on real sockets (``127.0.0.1:0``, each test under ``trio.fail_after``,
never the autojump clock): every fault mode byte for byte on the wire (chunked framing
included: the cut modes leave no terminator, ``reset`` is a TCP RST, ``stall`` keeps the
connection open), what the official ``openai`` client and ``httpx`` raise for each mode
(the table in ``docs/test-harness.md`` must match what this measures), and a plain
hypercorn launch with the harness switched on by its environment variable."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio

from inference_lab.core.config import FAULT_MODES
from inference_lab.serve import ServeState, create_app, get_state
from inference_lab.serve.harness.frames import CANCELLED_499, ERROR_400_IN_SSE, ERROR_ENVELOPE_200
from tests.conftest import GPT, ROOT, make_settings
from tests.harness_util import chat_frame, content_frames, head_of
from tests.serve_util import assert_idle, serving

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")

DONE = b"data: [DONE]\n\n"
DOCS = ROOT / "docs" / "test-harness.md"


@asynccontextmanager
async def harness_server() -> AsyncIterator[tuple[str, int, ServeState]]:
    """A real server in this process with the harness on: (base URL, port, state)."""
    app = create_app(attrs.evolve(make_settings(), enable_test_harness=True))
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}", port, get_state(app)


@attrs.frozen
class Wire:
    """One response as it came off the socket."""

    status: int
    headers: dict[str, str]
    #: The chunks of the chunked body, in order (a last one may be incomplete).
    chunks: list[bytes]
    #: The body ended with the chunked terminator (``0\\r\\n\\r\\n``).
    terminated: bool
    #: How the connection ended: ``eof`` (FIN), ``reset`` (RST) or ``open`` (still open).
    ending: str


def request_bytes(body: Any, fault: str | None, port: int) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n"
        "connection: close\r\n"
    )
    if fault is not None:
        head += f"x-inference-lab-fault: {fault}\r\n"
    return head.encode() + b"\r\n" + payload


def dechunk(body: bytes) -> tuple[list[bytes], bool]:
    chunks: list[bytes] = []
    pos = 0
    while True:
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            return chunks, False
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:
            return chunks, body[eol + 2 :] == b"\r\n"
        start, end = eol + 2, eol + 2 + size
        chunks.append(body[start:end])
        if end + 2 > len(body):
            return chunks, False
        assert body[end : end + 2] == b"\r\n"
        pos = end + 2


async def wire_request(port: int, body: Any, fault: str | None, idle: float | None = None) -> Wire:
    """Send one request on a fresh connection and read until EOF, a reset, or (with
    ``idle``) ``idle`` seconds without data."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    data = bytearray()
    ending = "eof"
    try:
        await stream.send_all(request_bytes(body, fault, port))
        while True:
            if idle is not None:
                with trio.move_on_after(idle):
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    data += chunk
                    continue
                ending = "open"
                break
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
    except trio.BrokenResourceError as exc:
        assert isinstance(exc.__cause__, ConnectionResetError), exc
        ending = "reset"
    finally:
        await stream.aclose()
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers.get("transfer-encoding") == "chunked", headers
    chunks, terminated = dechunk(rest)
    return Wire(status, headers, chunks, terminated, ending)


def body_for(**extra: Any) -> dict[str, Any]:
    return {
        "model": GPT,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 20,
        "stream": True,
        **extra,
    }


def expected_chunks(mode: str, head: bytes, include_usage: bool) -> list[bytes]:
    """The chunks a fault with the default ``after_chunks`` (3) writes, in order."""
    role = chat_frame(head, {"role": "assistant"})
    content = content_frames(head, 4)
    finish = chat_frame(head, {}, b',"finish_reason":"stop"')
    if mode == "mid_reasoning":
        partial = [chat_frame(head, {"reasoning_content": w}) for w in ("the ", "of ", "and ")]
        return [role, *partial]
    if mode == "mid_tool_call":
        call = {
            "index": 0,
            "id": "call_fault_0",
            "type": "function",
            "function": {"name": "get_current_weather", "arguments": ""},
        }
        args = ['{"location":"San Francisco, CA","notes":"', "and "]
        return [
            role,
            chat_frame(head, {"tool_calls": [call]}),
            *(
                chat_frame(head, {"tool_calls": [{"index": 0, "function": {"arguments": a}}]})
                for a in args
            ),
        ]
    base = [role, *content[:3]]
    if mode in ("cut_between_frames", "reset", "stall"):
        return base
    if mode == "cut_mid_frame":
        return [*base, content[3][: len(content[3]) // 2]]
    if mode == "error_envelope_200":
        return [*base, ERROR_ENVELOPE_200 + DONE]
    if mode == "error_400_in_sse":
        return [*base, ERROR_400_IN_SSE]
    if mode == "cancelled_499":
        return [*base, CANCELLED_499]
    if mode == "no_usage":
        return [*base, finish + DONE]
    assert mode == "no_done"
    if not include_usage:
        return [*base, finish]
    return base  # (the usage frame's prompt count is checked apart)


#: How each mode's connection ends on the wire: (chunked terminator sent, ending).
WIRE_ENDINGS = {
    "cut_between_frames": (False, "eof"),
    "cut_mid_frame": (False, "eof"),
    "reset": (False, "reset"),
    "stall": (False, "open"),
    "error_envelope_200": (True, "eof"),
    "error_400_in_sse": (True, "eof"),
    "no_done": (True, "eof"),
    "no_usage": (True, "eof"),
    "cancelled_499": (True, "eof"),
    "mid_reasoning": (False, "eof"),
    "mid_tool_call": (False, "eof"),
}


async def test_every_mode_on_the_wire_byte_for_byte() -> None:
    """Each of the 11 modes: a 200 event stream whose chunks are exactly the frames the
    spec fixes, then the mode's ending on the connection itself."""
    assert set(WIRE_ENDINGS) == set(FAULT_MODES)
    with trio.fail_after(30):
        async with harness_server() as (_, port, state):
            for mode in FAULT_MODES:
                for include_usage in (False, True):
                    body = body_for(stream_options={"include_usage": include_usage})
                    wire = await wire_request(
                        port, body, f"{mode};delay_ms=0", idle=0.3 if mode == "stall" else None
                    )
                    assert (wire.status, wire.headers["content-type"]) == (200, "text/event-stream")
                    head = head_of(wire.chunks[0])
                    expected = expected_chunks(mode, head, include_usage)
                    if mode == "no_done" and include_usage:
                        assert wire.chunks[:4] == expected
                        last = wire.chunks[4]
                        finish = chat_frame(head, {}, b',"finish_reason":"stop"')
                        assert last.startswith(finish + head + b'"choices":[],"usage":{')
                        assert (
                            json.loads(last[len(finish) + 6 :])["usage"]["completion_tokens"] == 3
                        )
                        assert not last.endswith(DONE) and len(wire.chunks) == 5
                    else:
                        assert wire.chunks == expected, mode
                    assert (wire.terminated, wire.ending) == WIRE_ENDINGS[mode], mode
            assert state.runtimes[GPT].snapshot().admitted == 0


async def test_reset_is_a_tcp_rst_under_the_real_server() -> None:
    """``reset`` finds the connection's socket under hypercorn's trio worker (the server
    ``inference-lab serve`` runs) and the client sees ECONNRESET, not a FIN. If this fails,
    :func:`inference_lab.serve.transport.connection_socket` does not find the socket
    (the transport's ``connection_socket`` no longer reaches the connection's socket)."""
    with trio.fail_after(10):
        async with harness_server() as (_, port, _state):
            wire = await wire_request(port, body_for(), "reset;delay_ms=0;after_chunks=1")
    assert wire.ending == "reset", (
        "the reset fault closed with a FIN: connection_socket() did not find the socket "
        "of the connection under the real server"
    )
    assert len(wire.chunks) == 2 and not wire.terminated


async def test_stall_holds_the_connection_until_the_client_leaves() -> None:
    with trio.fail_after(10):
        async with harness_server() as (_, port, _state):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(request_bytes(body_for(), "stall;delay_ms=0", port))
            data = b""
            while data.count(b'"content"') < 3:
                data += await stream.receive_some(65536)
            with trio.move_on_after(0.5) as idle:
                data += await stream.receive_some(65536)
            assert idle.cancelled_caught, "the stalled stream sent more (or closed)"
            await stream.aclose()
            wire = await wire_request(port, body_for(), "no_usage;delay_ms=0")
            assert wire.terminated  # the server goes on serving


async def test_paced_reset_on_the_wire_leaves_the_engine_idle() -> None:
    with trio.fail_after(10):
        async with harness_server() as (_, port, state):
            wire = await wire_request(
                port, body_for(max_tokens=500), "reset;paced=true;after_chunks=5"
            )
            assert wire.ending == "reset" and len(wire.chunks) >= 2
            content = b"".join(wire.chunks).count(b'"delta":{"content"')
            assert content == 5
            rt = state.runtimes[GPT]
            assert_idle(rt)
            assert (rt.snapshot().admitted, rt.engine.statistics().aborted) == (1, 1)


# -- what clients raise --------------------------------------------------------------------------


def _name(exc: BaseException | None) -> str:
    if exc is None:
        return "none"
    package = type(exc).__module__.split(".")[0]
    text = f"`{package}.{type(exc).__name__}`"
    cause = exc.__cause__
    if package == "openai" and cause is not None:
        cause_package = type(cause).__module__.split(".")[0]
        text += f" (from `{cause_package}.{type(cause).__name__}`)"
    return text


async def measure_clients(url: str, mode: str) -> tuple[str, str]:
    """What the official client (streaming ``chat.completions.create``, iterated to the
    end) and httpx (``stream`` + ``aiter_lines``) raise on ``mode``; read timeout 0.5 s."""
    timeout = httpx.Timeout(5.0, read=0.5)
    sdk_timeout = openai.Timeout(5.0, read=0.5)  # the SDK's own HTTP library's type
    headers = {"x-inference-lab-fault": f"{mode};delay_ms=0"}
    body = body_for(stream_options={"include_usage": True})
    raised: BaseException | None = None
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=sdk_timeout
    )
    try:
        stream = await client.chat.completions.create(
            model=GPT,
            messages=body["messages"],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
        )
        async for _ in stream:
            pass
    except Exception as exc:  # noqa: BLE001 - what is raised is the measurement
        raised = exc
    finally:
        await client.close()
    raised_httpx: BaseException | None = None
    try:
        async with httpx.AsyncClient(timeout=timeout) as plain:
            async with plain.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers
            ) as response:
                assert response.status_code == 200
                async for _ in response.aiter_lines():
                    pass
    except Exception as exc:  # noqa: BLE001 - what is raised is the measurement
        raised_httpx = exc
    return _name(raised), _name(raised_httpx)


def documented_table() -> dict[str, tuple[str, str]]:
    """The client table of ``docs/test-harness.md``: mode -> (openai, httpx)."""
    text = DOCS.read_text()
    section = text.split("<!-- client-table -->")[1]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `(\w+)` \| (.+?) \| (.+?) \|", line.strip())
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


async def test_client_exceptions_match_the_documented_table() -> None:
    """The docs' table of what the official openai client and httpx raise per mode is
    measured here, against the real server: a change on either side fails this test."""
    with trio.fail_after(60):
        async with harness_server() as (url, _, _state):
            measured = {mode: await measure_clients(url, mode) for mode in FAULT_MODES}
    documented = documented_table()
    assert measured == documented, json.dumps(measured, indent=1)


# -- a plain hypercorn launch --------------------------------------------------------------------


async def test_plain_hypercorn_launch_with_the_harness_and_a_fault_table(tmp_path: Path) -> None:
    """``INFERENCE_LAB_ENABLE_TEST_HARNESS=1`` under ``hypercorn --worker-class trio`` (a
    whole server process, warm-up included): the fault header works, ``reset`` is a real
    RST in that server too, and the model's ``[fault]`` table (``stall``) stalls streams
    without a header but not the start-up (the warm-up runs without the table)."""
    config = tmp_path / "gpt-oss-20b.toml"
    config.write_text(
        (ROOT / "configs" / "gpt-oss-20b.toml").read_text() + '\n[fault]\nmode = "stall"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_LAB_")}
    env.update(
        INFERENCE_LAB_CONFIG=str(config),
        INFERENCE_LAB_HARDWARE_PROFILES=str(ROOT / "hardware_profiles"),
        INFERENCE_LAB_ENABLE_TEST_HARNESS="1",
        PYTHONUNBUFFERED="1",
    )
    with trio.fail_after(30):
        proc = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "hypercorn",
                "--worker-class",
                "trio",
                "-b",
                "127.0.0.1:0",
                "inference_lab.serve:create_app()",
            ],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        try:
            assert proc.stderr is not None
            seen = ""
            pattern = re.compile(r"Running on http://127\.0\.0\.1:(\d+)")
            with trio.fail_after(8):  # a warm-up stalled by the table would take 10 s
                while not (match := pattern.search(seen)):
                    chunk = await proc.stderr.receive_some(4096)
                    assert chunk, f"hypercorn ended: {seen}"
                    seen += chunk.decode()
            port = int(match.group(1))
            wire = await wire_request(port, body_for(), "reset;delay_ms=0;after_chunks=2")
            assert wire.ending == "reset" and len(wire.chunks) == 3
            wire = await wire_request(port, body_for(), "no_usage;delay_ms=0")
            assert wire.terminated and wire.chunks[-1].endswith(DONE)
            wire = await wire_request(port, body_for(), None, idle=0.3)
            assert (wire.ending, len(wire.chunks)) == ("open", 4)  # role + 3, then stalled
        finally:
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
