"""The two capacity dials seen from HTTP, on a virtual clock: 503 vs 529 across models, and
``max_num_seqs`` lowered live cutting throughput by the roofline's factor."""

from __future__ import annotations

import json

import numpy as np
import trio
import trio.testing

from inference_lab.core.roofline import Roofline
from tests.conftest import GPT, LLAMA, ServeFactory, chat_body, make_settings


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def test_dead_engine_503_while_other_model_529s_by_its_own_bound(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A crashed model answers 503 even with its queue bound reached; the other model keeps
    refusing with 529 by its own bound, and admits again below it."""
    async with serve(make_settings(GPT, LLAMA, max_waiting=1, max_num_seqs=1)) as s:
        dead = s.runtime(GPT)
        dead.stop()
        dead._pending = 3  # as if its bound (1) were long reached
        async with trio.open_nursery() as nursery:
            async with s.stream(chat_body(model=LLAMA, max_tokens=50, stream=True)) as running:
                await running.next_chunk()  # admitted: role frame
                async with s.stream(chat_body(model=LLAMA, max_tokens=5, stream=True)) as queued:
                    await settle()
                    snap = s.runtime(LLAMA).snapshot()
                    assert (snap.running, snap.depth) == (1, 1)
                    full = await s.post("/v1/chat/completions", chat_body(model=LLAMA))
                    assert full.status_code == 529
                    body = json.loads(await full.get_data())
                    assert body["error"]["code"] == "queue_saturated"
                    gone = await s.post("/v1/chat/completions", chat_body(model=GPT))
                    assert gone.status_code == 503
                    body = json.loads(await gone.get_data())
                    assert body["error"]["code"] == "engine_unavailable"
                    await queued.read_all()
                    await running.read_all()
            nursery.cancel_scope.cancel()
        ok = await s.post("/v1/chat/completions", chat_body(model=LLAMA, max_tokens=2))
        assert ok.status_code == 200


async def test_lowering_max_num_seqs_cuts_throughput_by_the_roofline_factor(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Eight closed-loop clients against cap 4, then cap 2 set live: tokens per second fall
    by the factor the roofline predicts for decode batches of 2 against 4 (within 3 %,
    the prefill steps being the difference), and no request is lost."""
    clients, max_tokens, phase = 8, 60, 2.0
    async with serve(make_settings(max_num_seqs=4)) as s:
        token_times: list[float] = []
        completed = 0
        stop = trio.Event()

        async def client() -> None:
            nonlocal completed
            while not stop.is_set():
                body = chat_body(max_tokens=max_tokens, stream=True)
                async with s.stream(body) as st:
                    await st.read_all()
                assert len(st.token_times()) == max_tokens
                token_times.extend(st.token_times())
                completed += 1

        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(client)
            start = trio.current_time()
            await trio.sleep(phase)
            changed = trio.current_time()
            response = await s.post("/control/capacity", {"max_num_seqs": 2})
            assert response.status_code == 200
            await trio.sleep(phase)
            stop.set()
        end = trio.current_time()
        assert completed > 0 and s.runtime().snapshot().running == 0

        def rate(lo: float, hi: float) -> float:
            return sum(1 for t in token_times if lo <= t < hi) / (hi - lo)

        # skip the first half second of each phase (ramp-up, and the drain from 4 to 2)
        before = rate(start + 0.5, changed)
        after = rate(changed + 0.5, end - 0.1)
        roof = Roofline(s.runtime().deployment)
        context = np.int64(5 + max_tokens // 2)

        def decode_rate(batch: int) -> float:
            n = np.ones(batch, dtype=np.int64)
            return batch / roof.step_time(n, np.full(batch, context))

        predicted = decode_rate(2) / decode_rate(4)
        assert after < before
        assert abs(after / before - predicted) / predicted < 0.03, (after / before, predicted)


async def test_serving_teardown_stops_every_background_task_at_once(serve: ServeFactory) -> None:
    """The serving teardown stops the runtimes and the writers' releaser itself: the
    server never waits for the ASGI server's shutdown timeout to cancel them."""
    cm = serve(make_settings())
    s = await cm.__aenter__()
    async with s.stream(chat_body(max_tokens=3, stream=True)) as st:
        await st.read_all()
    start = trio.current_time()
    await cm.__aexit__(None, None, None)
    assert trio.current_time() - start < 1.0
