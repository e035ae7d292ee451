"""End to end on real sockets (``127.0.0.1:0``, port from ``nursery.start``), each under
``trio.fail_after`` and never with the autojump clock: the official ``openai`` client, a
529 it must not retry, the hypercorn socket fixes, and real process launches
(``hypercorn --worker-class trio`` and ``inference-lab serve`` with SIGINT / SIGTERM)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import openai
import pytest
import trio

from tests.conftest import GPT, ROOT, make_settings
from tests.serve_util import http_request, read_until_eof, running_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets and signals")


# -- the official client -------------------------------------------------------------------------


async def test_openai_client_streams_with_usage_and_completes() -> None:
    with trio.fail_after(20):
        async with running_server(make_settings()) as (url, _, state):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            stream = await client.chat.completions.create(
                model=GPT,
                messages=[{"role": "user", "content": "hello world"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "the of and to in"  # the last word has no trailing space
            assert chunks[0].choices[0].delta.role == "assistant"
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            assert chunks[-1].usage is not None
            assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 5)

            completion = await client.chat.completions.create(
                model=GPT, messages=[{"role": "user", "content": "hello world"}], max_tokens=3
            )
            assert completion.choices[0].message.content == "the of and"
            assert completion.usage is not None and completion.usage.total_tokens == 8
            legacy = await client.completions.create(model=GPT, prompt="hello world", max_tokens=2)
            assert legacy.choices[0].text == "the of"
            models = await client.models.list()
            assert [m.id for m in models.data] == [GPT]
            await client.close()
            assert state.runtimes[GPT].snapshot().admitted == 3


async def test_openai_client_sees_529_without_retrying() -> None:
    """A streaming request refused with 529 surfaces as APIStatusError 529; the SDK's
    default retries do not fire (x-should-retry: false): the server saw one refusal."""
    with trio.fail_after(20):
        settings = make_settings(max_num_seqs=1, max_waiting=1)
        async with running_server(settings) as (url, _, state):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")  # retries on
            messages = [{"role": "user", "content": "hello world"}]
            running = await client.chat.completions.create(
                model=GPT,
                messages=messages,
                max_tokens=2000,
                stream=True,  # type: ignore[arg-type]
            )
            await running.__anext__()
            waiting = await client.chat.completions.create(
                model=GPT,
                messages=messages,
                max_tokens=2,
                stream=True,  # type: ignore[arg-type]
            )
            await waiting.__anext__()
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(
                    model=GPT,
                    messages=messages,
                    max_tokens=2,
                    stream=True,  # type: ignore[arg-type]
                )
            assert info.value.status_code == 529
            assert info.value.response.headers["x-should-retry"] == "false"
            assert info.value.response.headers["content-type"] == "application/json"
            assert state.runtimes[GPT].snapshot().refused == 1
            await running.close()
            await waiting.close()
            await client.close()


# -- the socket fixes --------------------------------------------------------------------------------


async def test_connection_close_is_honoured() -> None:
    """The server closes a `Connection: close` exchange (non-streaming and streaming):
    the final send is shielded from quart-trio's disconnect cancellation (hypercorn #330)."""
    with trio.fail_after(10):
        async with running_server(make_settings()) as (_, port, _state):
            for request in (
                http_request("GET", "/health", close=True),
                http_request(
                    "POST",
                    "/v1/chat/completions",
                    {
                        "model": GPT,
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 3,
                        "stream": True,
                    },
                    close=True,
                ),
            ):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(request)
                data = await read_until_eof(stream)
                assert data.startswith(b"HTTP/1.1 200")
                await stream.aclose()
            assert data.rstrip(b"\r\n0").endswith(b"data: [DONE]")


async def test_idle_keep_alive_connection_is_reaped() -> None:
    """After a complete response on a keep-alive connection, the idle timer is re-armed
    (the final send is shielded) and the server closes the idle socket."""
    with trio.fail_after(10):
        async with running_server(make_settings(), keep_alive_timeout=0.3) as (_, port, _state):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(http_request("GET", "/health"))
            await stream.send_all(http_request("GET", "/v1/models"))
            data = await read_until_eof(stream)
            assert data.count(b"HTTP/1.1 200") == 2
            await stream.aclose()


class AbortSpy:
    """Wraps an Engine and sets ``aborted`` when ``abort`` is called."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.aborted = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def abort(self, request_id: int) -> bool:
        self.aborted.set()
        result: bool = self._engine.abort(request_id)
        return result


async def test_client_leaving_a_real_socket_aborts_its_request() -> None:
    with trio.fail_after(10):
        async with running_server(make_settings()) as (_, port, state):
            rt = state.runtimes[GPT]
            spy = AbortSpy(rt.engine)
            rt.engine = spy  # type: ignore[assignment]
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            body = {
                "model": GPT,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 100_000,
                "stream": True,
            }
            await stream.send_all(http_request("POST", "/v1/chat/completions", body))
            data = b""
            while data.count(b"content") < 3:
                data += await stream.receive_some(65536)
            assert rt.snapshot().running == 1
            await stream.aclose()
            await spy.aborted.wait()
            stats = rt.engine.statistics()
            assert (stats.running, stats.kv_used_blocks, stats.aborted) == (0, 0, 1)


# -- real launches -----------------------------------------------------------------------------------


async def _read_line_matching(
    proc: trio.Process, stream: trio.abc.ReceiveStream, pattern: re.Pattern[str]
) -> tuple[re.Match[str], str]:
    seen = ""
    while True:
        chunk = await stream.receive_some(4096)
        if not chunk:
            raise AssertionError(f"process ended before {pattern.pattern!r}: {seen}")
        seen += chunk.decode()
        match = pattern.search(seen)
        if match:
            return match, seen


async def _get(port: int, path: str) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(http_request("GET", path, close=True))
    data = await read_until_eof(stream)
    await stream.aclose()
    return data


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_LAB_")}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


async def test_plain_hypercorn_launch_serves_the_env_configured_app() -> None:
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
            env=_env(
                INFERENCE_LAB_CONFIG="configs/gpt-oss-20b.toml", INFERENCE_LAB_MAX_WAITING="5"
            ),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        try:
            assert proc.stderr is not None
            match, _ = await _read_line_matching(
                proc, proc.stderr, re.compile(r"Running on http://127\.0\.0\.1:(\d+)")
            )
            port = int(match.group(1))
            data = await _get(port, "/v1/models")
            assert data.startswith(b"HTTP/1.1 200")
            assert json.loads(data.split(b"\r\n\r\n", 1)[1])["data"][0]["id"] == GPT
            data = await _get(port, "/control/capacity")
            assert json.loads(data.split(b"\r\n\r\n", 1)[1])[0]["max_waiting"] == 5
        finally:
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@pytest.mark.parametrize(
    "workers", [[], ["--workers", "1"], ["--workers", "2"], ["--workers", "0"]]
)
@pytest.mark.parametrize(
    ("variables", "line"),
    [
        (
            {"INFERENCE_LAB_MAX_WAITING": "-1"},
            "inference-lab: error: INFERENCE_LAB_MAX_WAITING: must be an integer >= 0, got -1",
        ),
        (
            {"INFERENCE_LAB_CONFIG": "configs/missing.toml"},
            "inference-lab: error: configs/missing.toml: no such file or directory",
        ),
    ],
)
def test_a_plain_hypercorn_launch_that_cannot_start_exits_non_zero(
    workers: list[str], variables: dict[str, str], line: str
) -> None:
    """A bad variable or a missing config: a worker prints one line, no traceback, and
    the hypercorn process a supervisor started exits non-zero, with hypercorn's own worker
    processes (its default) as without (``--workers 0``). hypercorn 0.18's supervisor
    would exit 0 (serve/launch.py, Rule 2). With several workers, the first to fail ends
    the supervisor, and the others end with it (app Rule 3) before or after their line."""
    result = subprocess.run(
        [sys.executable, "-m", "hypercorn", "--worker-class", "trio", *workers,
         "-b", "127.0.0.1:0", "inference_lab.serve:create_app()"],
        cwd=ROOT, env=_env(**variables), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0, result.stderr
    most = max(1, int(workers[1]) if workers else 1)
    lines = result.stderr.splitlines()
    if most > 1:
        # A second worker ended by its parent's death mid-start can leave Python's
        # multiprocessing resource tracker a semaphore to report (its two lines): the
        # tracker's words, not the launch's.
        lines = [
            line
            for line in lines
            if "resource_tracker" not in line and not line.startswith("  warnings.warn(")
        ]
    assert 1 <= len(lines) <= most and set(lines) == {line}, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_inference_lab_serve_exits_cleanly_on_signal_after_in_flight_stream(
    signum: signal.Signals,
) -> None:
    """Banner on stdout; a signal mid-stream lets the stream finish ([DONE]) within the
    grace period; exit code 0 and no traceback."""
    with trio.fail_after(30):
        proc = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "inference_lab.cli",
                "serve",
                "--port",
                "0",
                "--config",
                "configs/gpt-oss-20b.toml",
                "--max-waiting",
                "7",
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            match, banner = await _read_line_matching(
                proc, proc.stdout, re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
            )
            assert GPT in banner and "max_num_seqs 256" in banner and "max_waiting 7" in banner
            assert "on b200" in banner
            port = int(match.group(1))
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            body = {
                "model": GPT,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 400,
                "ignore_eos": True,  # runs to max_tokens, as vLLM's field asks
                "stream": True,
            }
            await stream.send_all(http_request("POST", "/v1/chat/completions", body, close=True))
            first = await stream.receive_some(65536)
            assert first.startswith(b"HTTP/1.1 200")
            proc.send_signal(signum)
            rest = await read_until_eof(stream)
            assert (first + rest).count(b'"content"') == 400
            assert b"data: [DONE]" in rest
            code = await proc.wait()
            err = (await proc.stderr.receive_some(65536)).decode()
            assert code == 0, err
            assert "Traceback" not in err
            assert "stopped" in err
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def test_serve_cli_startup_errors_are_one_line_with_the_documented_exit_code(
    tmp_path: Any,
) -> None:
    """Each startup failure: one line on stderr, nothing served; exit code 2 for a bad
    command line, 1 for a command line that is fine but cannot be served."""
    cases = [
        (["--max-waiting", "x"], "argument --max-waiting: must be an integer >= 0", 2),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an integer >= 1", 2),
        (["--config", str(tmp_path / "missing")], "no such file or directory", 1),
        (["--config", "configs/gpt-oss-20b.toml", "--hardware", "a100"], "hardware.a100", 1),
    ]
    for args, fragment, code in cases:
        result = subprocess.run(
            [sys.executable, "-m", "inference_lab.cli", "serve", "--port", "0", *args],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == code, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], (args, result.stderr)
        assert result.stdout == ""
