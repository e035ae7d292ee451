"""The start-up warm-up of a server process (inference_lab/serve/warmup.py).

Rule 1: it runs on a throwaway state, so the served runtimes start untouched.
Rule 2: every warm-up request is served in memory and then through hypercorn's own
connection server over a socket pair.
Rule 3: the served runtimes' pacers start from the warm-up's pacing calibration.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from inference_lab.runtime.calibration import PacingCalibration
from inference_lab.runtime.timer import timerfd_available
from inference_lab.serve import app as app_module
from inference_lab.serve import create_app, warmup
from inference_lab.serve.asgi import get_state
from inference_lab.serve.state import ServeState
from tests.conftest import GPT, make_settings


@pytest.fixture
def restore_gc() -> Iterator[None]:
    """A server process's start freezes the heap and raises the collector's thresholds:
    undo both for the rest of the test session."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


async def test_a_request_through_hypercorns_connection_server_is_answered() -> None:
    """The hypercorn leg of the warm-up really serves: a stream ends with [DONE] and the
    chunked terminator, an unknown model is a 404 envelope."""
    state = ServeState.build(make_settings())
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await state.start(nursery)
            try:
                stream = await warmup._through_hypercorn(
                    state,
                    "completions",
                    {"model": GPT, "prompt": "warm up", "max_tokens": 2, "stream": True},
                )
                missing = await warmup._through_hypercorn(
                    state, "chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
                )
            finally:
                await state.stop()
    assert stream.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" in stream and stream.endswith(b"0\r\n\r\n")
    assert missing.startswith(b"HTTP/1.1 404") and b'"model_not_found"' in missing


async def test_a_server_process_warms_both_ways_and_starts_its_runtimes_untouched(
    monkeypatch: pytest.MonkeyPatch, restore_gc: None
) -> None:
    """Every warm-up request runs in memory and through hypercorn, each answered; the
    served runtime has admitted nothing when serving starts."""
    answers: dict[str, list[Any]] = {"memory": [], "hypercorn": []}
    in_memory, through = warmup._exchange, warmup._through_hypercorn

    async def record_memory(*args: Any) -> list[dict[str, Any]]:
        answers["memory"].append(sent := await in_memory(*args))
        return sent

    async def record_hypercorn(*args: Any) -> bytes:
        answers["hypercorn"].append(raw := await through(*args))
        return raw

    monkeypatch.setattr(warmup, "_exchange", record_memory)
    monkeypatch.setattr(warmup, "_through_hypercorn", record_hypercorn)
    app = create_app(make_settings(), server_process=True)
    with trio.fail_after(20):
        async with app.test_app():
            stats = get_state(app).runtimes[GPT].statistics()
    expected = len(warmup._requests(GPT))
    assert len(answers["memory"]) == len(answers["hypercorn"]) == expected
    statuses = [raw[9:12] for raw in answers["hypercorn"]]
    assert statuses.count(b"200") == expected - 2 and b"400" in statuses and b"404" in statuses
    assert stats.snapshot.admitted == 0 and stats.engine.steps == 0


async def test_a_failing_hypercorn_leg_is_logged_and_serving_starts(
    monkeypatch: pytest.MonkeyPatch, restore_gc: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The hypercorn leg is only a warm-up: if hypercorn's internals changed under it, the
    server logs one warning and serves anyway."""

    async def broken(*args: Any) -> bytes:
        raise TypeError("TCPServer() takes 4 positional arguments")

    monkeypatch.setattr(warmup, "_through_hypercorn", broken)
    app = create_app(make_settings(), server_process=True)
    with trio.fail_after(20):
        async with app.test_app() as test_app:
            client = test_app.test_client()
            response = await client.get("/health")
    assert response.status_code == 200
    [record] = [r for r in caplog.records if "warm-up through hypercorn" in r.getMessage()]
    assert record.levelname == "WARNING" and "TypeError" in record.getMessage()


async def test_the_served_runtimes_start_from_the_warm_ups_pacing_calibration(
    monkeypatch: pytest.MonkeyPatch, restore_gc: None
) -> None:
    """Rule 3: what the warm-up's pacers learned of this machine's timer (where the
    timer is precise: a Linux timerfd under the real clock) is where the served
    runtimes' pacers start; nothing else of theirs is touched."""
    learned: list[dict[str, PacingCalibration]] = []
    real = warmup.warm_up

    async def recording(settings: Any) -> dict[str, PacingCalibration]:
        learned.append(result := await real(settings))
        return result

    monkeypatch.setattr(app_module, "warm_up", recording)
    app = create_app(make_settings(), server_process=True)
    with trio.fail_after(20):
        async with app.test_app():
            runtime = get_state(app).runtimes[GPT]
            calibration, snap = runtime.calibration(), runtime.snapshot()
    [found] = learned
    if timerfd_available():
        assert found[GPT].samples > 0  # its streams' steps woke the pacer
        assert calibration == found[GPT]
    else:
        assert found == {} and calibration == PacingCalibration()
    assert snap.admitted == 0 and snap.events == 0
