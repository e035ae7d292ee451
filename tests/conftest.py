"""Shared fixtures for the serve tests (``tests/test_serve_*.py``).

``serve(settings)`` runs a fresh app in-process (Quart's test app: lifespan included) and
gives a :class:`Served` handle with the test client; ``settings_for(...)`` builds serve
settings from the shipped configs. Time-dependent tests add pytest-trio's
``autojump_clock`` fixture (``MockClock(autojump_threshold=0)``): a paced stream then takes
microseconds and virtual times are exact. Never combine that clock with real sockets.

``serve_both(settings)`` is ``serve`` run twice, once in memory and once on a real
socket (``tests/serve_util.py``: the app served as ``inference-lab serve`` serves it, so
the transport's hooks are on the path); a test using it is written against what both
handles offer (``post``, ``post_raw``, ``get_json``, ``stream``, ``runtime``, ``state``)
and runs on the real clock.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from inference_lab.core.config import load_deployment, load_workload
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve import ServeSettings, ServeState, create_app, get_state
from tests.serve_util import SocketServed, StreamFrames, serving
from tests.slow import SLOW_MODULES, SLOW_TESTS

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: left out of `make test-fast` (tests/slow.py lists them)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests ``tests/slow.py`` lists as ``slow`` (``make test-fast`` runs the
    others: ``pytest -m "not slow"``)."""
    for item in items:
        module = item.path.name
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        if module in SLOW_MODULES or name in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)


CONFIGS = ROOT / "configs"
GPT = "gpt-oss-20b"
LLAMA = "Llama-3.1-8B-Instruct"
CONFIG_FILES = {
    GPT: CONFIGS / "gpt-oss-20b.toml",
    LLAMA: CONFIGS / "Llama-3.1-8B-Instruct.toml",
    "Llama-3-70B": CONFIGS / "Llama-3-70B.toml",
}


def make_settings(
    *models: str,
    hardware: str = "b200",
    workload: str | None = None,
    seed: int | None = None,
    default_max_tokens: int = 256,
    run_to_max_tokens: bool = True,
    **scheduler: Any,
) -> ServeSettings:
    """Serve settings for shipped models (default gpt-oss-20b on b200), with ``[scheduler]``
    keys overridden for every model. Prose answers run to their ``max_tokens`` unless
    ``run_to_max_tokens`` is False: most tests pin exact lengths and pacing, and the
    default length model has tests of its own (``test_serve_lengths.py``)."""
    deployments = []
    for model in models or (GPT,):
        dep = load_deployment(CONFIG_FILES[model], hardware)
        if scheduler:
            dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, **scheduler))
        deployments.append(dep)
    return ServeSettings(
        deployments=tuple(deployments),
        workload=load_workload(workload) if workload is not None else None,
        seed=seed,
        default_max_tokens=default_max_tokens,
        run_to_max_tokens=run_to_max_tokens,
    )


def chat_body(content: str = "hello world", max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": GPT,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    body.update(extra)
    return body


class Stream(StreamFrames):
    """One request on an in-memory ASGI connection (no sockets): the app runs in its own
    task; what it sends lands in a channel of ``window`` messages, so a test that stops
    reading stalls the app's writes as a full socket would. Quart's own test connection
    cannot be abandoned mid-stream (it waits for a final body that a cancelled app never
    sends), hence this small one."""

    def __init__(self, app: Any, path: str, body: bytes, window: int = 10) -> None:
        self.scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"localhost"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8080),
            "extensions": {},
            "state": {},
        }
        self.app = app
        self.body = body
        self._to_app_send, self._to_app_recv = trio.open_memory_channel[dict[str, Any]](math.inf)
        self._from_app_send, self._from_app_recv = trio.open_memory_channel[dict[str, Any]](window)
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[tuple[float, bytes]] = []
        self.ended = False
        self.app_done = trio.Event()

    async def _run_app(self) -> None:
        try:
            await self.app(self.scope, self._to_app_recv.receive, self._from_app_send.send)
        finally:
            self._from_app_send.close()
            self.app_done.set()

    def start(self, nursery: trio.Nursery) -> None:
        self._to_app_send.send_nowait(
            {"type": "http.request", "body": self.body, "more_body": False}
        )
        nursery.start_soon(self._run_app)

    async def next_chunk(self) -> bytes | None:
        """The next body write of the server (None once the body is complete)."""
        while not self.ended:
            try:
                message = await self._from_app_recv.receive()
            except trio.EndOfChannel:
                self.ended = True
                break
            if message["type"] == "http.response.start":
                self.status = message["status"]
                self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
                continue
            data: bytes = message.get("body", b"")
            if not message.get("more_body", False):
                self.ended = True
            if data:
                self.chunks.append((trio.current_time(), data))
                return data
        return None

    async def disconnect(self) -> None:
        """The client goes away: the app sees ``http.disconnect``; its output is dropped."""
        if not self.app_done.is_set():
            self._to_app_send.send_nowait({"type": "http.disconnect"})
        self.ended = True
        while True:
            try:
                await self._from_app_recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                break
        await self.app_done.wait()


@attrs.define
class Served:
    """A running in-process app: its test client and its runtimes."""

    app: Any
    client: Any
    state: ServeState

    def runtime(self, name: str = GPT) -> ModelRuntime:
        return self.state.runtimes[name]

    async def post(self, path: str, body: Any) -> Any:
        return await self.client.post(path, json=body)

    async def post_raw(self, path: str, data: bytes, content_type: str = "application/json") -> Any:
        """POST ``data`` as it is, declared as ``content_type``."""
        return await self.client.post(path, data=data, headers={"content-type": content_type})

    async def get_json(self, path: str) -> tuple[int, Any]:
        response = await self.client.get(path)
        return response.status_code, json.loads(await response.get_data())

    @asynccontextmanager
    async def stream(
        self,
        body: dict[str, Any],
        path: str = "/v1/chat/completions",
        window: int = 10,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> AsyncIterator[Stream]:
        """Send ``body`` (with extra request ``headers``) on an in-memory connection
        (streaming or not). Leaving the block before the response is complete
        disconnects the client."""
        stream = Stream(self.app, path, json.dumps(body).encode(), window)
        stream.scope["headers"].extend(headers)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            try:
                yield stream
            finally:
                with trio.CancelScope(shield=True):
                    if stream.ended:
                        await stream.app_done.wait()
                    else:
                        await stream.disconnect()


ServeFactory = Callable[..., AbstractAsyncContextManager[Served]]


@asynccontextmanager
async def _serve(settings: ServeSettings | None = None) -> AsyncIterator[Served]:
    app = create_app(settings if settings is not None else make_settings())
    async with app.test_app() as test_app:
        yield Served(app=app, client=test_app.test_client(), state=get_state(app))


@pytest.fixture
def serve() -> ServeFactory:
    """``async with serve(settings) as s:`` runs a fresh app (one app object per server)."""
    return _serve


@asynccontextmanager
async def _serve_on_socket(settings: ServeSettings | None = None) -> AsyncIterator[SocketServed]:
    app = create_app(settings if settings is not None else make_settings())
    async with serving(app) as port:
        yield SocketServed(app=app, port=port, state=get_state(app))


@pytest.fixture(params=["memory", "socket"])
def serve_both(request: pytest.FixtureRequest) -> ServeFactory:
    """``async with serve_both(settings) as s:`` runs a fresh app in memory, and in the
    test's second run on a real socket (never with the autojump clock)."""
    return _serve if request.param == "memory" else _serve_on_socket


@pytest.fixture
def settings_for() -> Callable[..., ServeSettings]:
    return make_settings
