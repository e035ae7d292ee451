"""``inference-lab proxy`` in front of ``serve --role prefill`` and ``serve --role decode``
on real sockets (``127.0.0.1:0``), driven by the official ``openai`` client, each test
under ``trio.fail_after`` and on the real clock: the hand-off streamed and not, the
529/503 contract (a decode server that would refuse is asked before the prefill is spent;
a prefill's refusal passes unchanged), backends that are down, a client that leaves, and
three real processes started from the command line.

The servers of most tests run in this process (``tests/serve_util.serving``: served as
``inference-lab serve`` serves them); the last test starts the three as processes.
Assertions are on counts and statuses only (timings belong to
``scripts/bench_pd_serve.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import openai
import pytest
import trio
import trio.testing

from inference_lab.cli import main
from inference_lab.client.http import parse_base_url
from inference_lab.proxy.app import ProxyApp, ProxyConfig
from inference_lab.proxy.handoff import prefill_request
from inference_lab.proxy.serving import bind, serve_proxy
from inference_lab.serve import ServeState, create_app, get_state
from tests.conftest import LLAMA, ROOT, make_settings
from tests.serve_util import serving

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets and signals")

PROMPT = "hello " * 100  # 159 chat prompt tokens: 10 blocks, 144 positions sent
MESSAGES = [{"role": "user", "content": PROMPT}]


def settings(role: str, **scheduler: Any) -> Any:
    return attrs.evolve(make_settings(LLAMA, hardware="h100", **scheduler), role=role)


@attrs.define
class Deployment:
    """A 1P1D deployment in this process: its proxy's URL and the servers' states."""

    url: str
    proxy: ProxyApp
    prefill: ServeState
    decode: ServeState
    prefill_url: str
    decode_url: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


def unused_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def proxy_on(config: ProxyConfig) -> AsyncIterator[tuple[str, ProxyApp]]:
    app = ProxyApp(config)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_proxy, app, sock, stop)
        try:
            yield f"http://127.0.0.1:{port}", app
        finally:
            stop.set()


@asynccontextmanager
async def deployment(
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    *,
    prefill_url: str | None = None,
    decode_url: str | None = None,
    probe: bool = True,
) -> AsyncIterator[Deployment]:
    """A prefill server, a decode server and the proxy, on 127.0.0.1 (a ``*_url`` given
    replaces that server: a backend that is down)."""
    p_app = create_app(settings("prefill", **(prefill or {})))
    d_app = create_app(settings("decode", **(decode or {})))
    async with serving(p_app) as p_port, serving(d_app) as d_port:
        purl = prefill_url or f"http://127.0.0.1:{p_port}"
        durl = decode_url or f"http://127.0.0.1:{d_port}"
        config = ProxyConfig(
            prefill=(parse_base_url(purl),), decode=(parse_base_url(durl),), probe=probe
        )
        async with proxy_on(config) as (url, proxy):
            yield Deployment(url, proxy, get_state(p_app), get_state(d_app), purl, durl)


def kv_in_use(state: ServeState) -> tuple[int, int, int]:
    """KV blocks used, requests held for a decode and requests live, on one server."""
    stats = state.runtimes[LLAMA].engine.statistics()
    held = sum(w.held for w in stats.workers)
    return stats.kv_used_blocks, held, state.runtimes[LLAMA].live


async def idle(*states: ServeState) -> None:
    """Assert that no server holds KV or requests once this process has nothing left to
    do (every task blocked for 10 ms: the releases crossed the sockets), looking again
    after each quiet spell, at most 100 times."""
    for _ in range(100):
        if all(kv_in_use(s) == (0, 0, 0) for s in states):
            return
        await trio.testing.wait_all_tasks_blocked(0.01)
    assert [kv_in_use(s) for s in states] == [(0, 0, 0)] * len(states)


def test_the_prefill_request_is_the_toy_proxys() -> None:
    """Step 2's body: vLLM's toy proxy's rewrite (max tokens 1, not streamed, no stream
    options or minimum lengths, do_remote_decode with null fields); the rest is kept."""
    raw = {
        "model": "m",
        "messages": [],
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "temperature": 0.5,
    }
    assert prefill_request(raw) == {
        "model": "m",
        "messages": [],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0.5,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert raw["max_tokens"] == 50  # (the original is what the decode server gets)


async def test_the_openai_client_through_a_1p1d_deployment() -> None:
    """Chat and completions, streamed and not, through the proxy: the answers are the
    placeholder text; every request was prefilled once (its KV held, then released by the
    decode server once pulled) and decoded once after a priced transfer; nothing is held
    or live anywhere afterwards."""
    with trio.fail_after(60):
        async with deployment() as pd:
            client = pd.client()
            chat = await client.chat.completions.create(
                model=LLAMA, messages=MESSAGES, max_tokens=4
            )
            assert chat.choices[0].message.content == "the of and to"
            assert chat.usage is not None and chat.usage.prompt_tokens == 159
            stream = await client.chat.completions.create(
                model=LLAMA,
                messages=MESSAGES,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "the of and to"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
            legacy = await client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=3)
            assert legacy.choices[0].text == "the of and"
            streamed = await client.completions.create(
                model=LLAMA, prompt=PROMPT, max_tokens=3, stream=True
            )
            assert "".join([c.choices[0].text async for c in streamed]) == "the of and"
            models = await client.models.list()
            assert [m.id for m in models.data] == [LLAMA]
            await client.close()
            await idle(pd.prefill, pd.decode)
            holds = pd.prefill.kv.holds
            assert holds is not None
            counts = holds.counts[LLAMA]
            assert (counts.held, counts.ended["released"], counts.claims) == (4, 4, 4)
            assert pd.decode.runtimes[LLAMA].engine.statistics().transfers == 4
            stats = pd.proxy.statistics()
            assert stats["completed"] == 4
            assert {stage: v["count"] for stage, v in stats["stages"].items()} == {
                "front": 4,
                "prefill": 4,
                "handoff": 4,
                "decode_head": 4,
            }


async def test_a_full_decode_server_refuses_before_the_prefill_is_spent() -> None:
    """The decode server's seat and waiting place taken (``max_num_seqs`` 1,
    ``max_waiting`` 1): the proxy's admission probe gets its 529 and passes it to the
    client unchanged (``Retry-After``, ``x-should-retry: false``); the prefill server never
    saw the refused request."""
    with trio.fail_after(60):
        async with deployment(decode={"max_num_seqs": 1, "max_waiting": 1}) as pd:
            client = pd.client()
            long = {"model": LLAMA, "messages": MESSAGES, "max_tokens": 4000, "stream": True}
            running = await client.chat.completions.create(**long)
            await running.__anext__()
            waiting = await client.chat.completions.create(**long)
            await waiting.__anext__()  # (its role frame: admitted, waiting)
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=2)
            assert info.value.status_code == 529
            headers = info.value.response.headers
            assert headers["x-should-retry"] == "false" and int(headers["retry-after"]) >= 1
            assert json.loads(info.value.response.content)["error"]["code"] == "queue_saturated"
            holds = pd.prefill.kv.holds
            assert holds is not None and holds.counts[LLAMA].held == 2
            assert pd.proxy.statistics()["probe_refusals"] == 1
            await running.close()
            await waiting.close()
            await client.close()
            await idle(pd.prefill, pd.decode)


async def test_a_prefill_refusal_passes_unchanged() -> None:
    """A prefill server that refuses (asleep: 503 ``engine_sleeping`` with Retry-After; a
    bad field: its 400 naming the field) has its answer reach the client as it was."""
    with trio.fail_after(60):
        async with deployment() as pd:
            client = pd.client()
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model=LLAMA, messages=MESSAGES, max_tokens=2, extra_body={"n": 0}
                )
            assert info.value.body is not None and info.value.body["param"] == "n"  # type: ignore[index]
            pd.prefill.runtimes[LLAMA].sleep_level = 1  # (what POST /sleep sets)
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=2)
            assert refused.value.status_code == 503
            assert "retry-after" in refused.value.response.headers
            assert json.loads(refused.value.response.content)["error"]["code"] == "engine_sleeping"
            pd.prefill.runtimes[LLAMA].sleep_level = 0
            assert pd.decode.runtimes[LLAMA].snapshot().admitted == 0
            await client.close()


async def test_a_backend_that_is_down_is_a_503_and_leaks_nothing() -> None:
    """A prefill backend that is down: 503 ``backend_unavailable`` naming it, at once. A
    decode backend that is down after the prefill: 503, and the proxy releases the KV the
    prefill held for it."""
    with trio.fail_after(60):
        down = f"http://127.0.0.1:{unused_port()}"
        async with deployment(prefill_url=down) as pd:
            client = pd.client()
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=2)
            assert info.value.status_code == 503
            error = json.loads(info.value.response.content)["error"]
            assert error["code"] == "backend_unavailable" and down in error["message"]
            await client.close()
        async with deployment(decode_url=down, probe=False) as pd:
            client = pd.client()
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=2)
            assert info.value.status_code == 503
            await client.close()
            await idle(pd.prefill)
            holds = pd.prefill.kv.holds
            assert holds is not None and holds.counts[LLAMA].ended["released"] == 1
            assert pd.proxy.statistics()["released"] == 1


async def test_a_client_that_leaves_mid_stream_leaks_nothing() -> None:
    """A client that leaves after its first tokens: the proxy closes its decode call, the
    decode server aborts the request; the prefill's KV was released when pulled."""
    with trio.fail_after(60):
        async with deployment() as pd:
            client = pd.client()
            stream = await client.chat.completions.create(
                model=LLAMA, messages=MESSAGES, max_tokens=4000, stream=True
            )
            await stream.__anext__()
            await stream.__anext__()
            await stream.close()
            await client.close()
            await idle(pd.prefill, pd.decode)
            assert pd.decode.runtimes[LLAMA].snapshot().aborted == 1


def test_bad_proxy_flags_are_one_line() -> None:
    """A URL that is not http:// is a usage error naming its flag (exit 2)."""
    assert main(["proxy", "--prefill", "ftp://a", "--decode", "http://127.0.0.1:1"]) == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(
            [
                "proxy",
                "--prefill",
                "http://127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:2",
                "--port",
                str(port),
            ]
        )
    assert code == 1


_URL = re.compile(r"listening on (http://\S+)")


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """``inference-lab ARGS`` as a process; its URL from its banner."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference_lab", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        match = _URL.search(line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise AssertionError(f"{args[0]} did not start: {proc.stderr.read() if proc.stderr else ''}")


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def test_three_processes_make_a_1p1d_deployment() -> None:
    """``serve --role prefill``, ``serve --role decode`` and ``proxy`` started from the
    command line on ports the kernel chose: the openai client streams through them, each
    stops with exit code 0 on SIGINT, saying nothing on stderr but its own lines."""
    common = ["--config", "Llama-3.1-8B-Instruct", "--hardware", "h100", "--port", "0"]
    procs: list[subprocess.Popen[str]] = []
    try:
        prefill, purl = _start(["serve", "--role", "prefill", *common])
        procs.append(prefill)
        decode, durl = _start(["serve", "--role", "decode", *common])
        procs.append(decode)
        proxy, url = _start(["proxy", "--prefill", purl, "--decode", durl, "--port", "0"])
        procs.append(proxy)

        async def drive() -> tuple[str, str]:
            with trio.fail_after(30):
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
                stream = await client.chat.completions.create(
                    model=LLAMA, messages=MESSAGES, max_tokens=5, stream=True
                )
                text = "".join([c.choices[0].delta.content or "" async for c in stream])
                whole = await client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=2)
                await client.close()
                return text, whole.choices[0].text

        assert trio.run(drive) == ("the of and to in", "the of")
    finally:
        results = [_stop(proc) for proc in reversed(procs)]
    for code, err in results:
        assert code == 0, err
        assert "Traceback" not in err, err


async def test_the_admission_probe_is_answered_where_it_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kv_routes Rule 3 / quick Rule 2: with 32 tasks always runnable, a decode server
    writes its answer to a served model's admission probe in the batch whose read brought
    it, as ``/health``; the answer is the route's (200, ``admits``). A model it does not
    serve goes the route's way: a 404 in the envelope."""
    from inference_lab.serve.kv_routes import admission_target
    from tests.serve_util import running_server
    from tests.test_serve_health import batches_from_read_to_answer, batches_of_work

    with trio.fail_after(30):
        async with running_server(settings("decode")) as (_, port, _state):
            async with batches_of_work() as counter:
                quick, answer = await batches_from_read_to_answer(
                    monkeypatch, port, counter, admission_target(LLAMA), False
                )
                _, unknown = await batches_from_read_to_answer(
                    monkeypatch, port, counter, admission_target("nope"), False
                )
    assert quick == 0
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["admits"] is True
    assert unknown.startswith(b"HTTP/1.1 404 ")
