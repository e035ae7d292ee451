"""What the live dashboard costs the server: CPU per sample and per connected page.

1. The sampler alone, in this process: ``Sampler.sample_now`` over every shipped model with
   their runtimes started, timed with the thread's CPU clock; once idle (no completions:
   the latency percentiles are reused) and once busy (each model's window full of
   ``RECENT_FINISHED`` completions and 50 new ones per tick, so the percentiles are
   recomputed every tick: the worst case).
2. Connected pages, against a real ``inference-lab serve`` (a subprocess): its own CPU
   seconds (``/control/stats``) over a window with 0, 1, 10 and 50 event streams open,
   idle, so the figure is the dashboard's alone.

Run: ``python scripts/bench_dashboard.py [--seconds 10]``. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import ServerProcess, get_stats  # noqa: E402

from inference_lab.serve.dashboard import SAMPLE_INTERVAL, Sampler  # noqa: E402
from inference_lab.serve.metrics import RECENT_FINISHED  # noqa: E402
from inference_lab.serve.settings import load_settings  # noqa: E402
from inference_lab.serve.state import ServeState  # noqa: E402


async def sampler_cost(ticks: int) -> tuple[int, float, float]:
    """(models, CPU µs per tick idle, CPU µs per tick busy)."""
    state = ServeState.build(load_settings())
    async with trio.open_nursery() as nursery:
        await state.start(nursery)
        sampler = Sampler(state)
        sampler.started = trio.current_time()

        def run(busy: bool) -> float:
            times = []
            for i in range(ticks):
                if busy:
                    for m in state.metrics.models.values():
                        now = trio.current_time() - m.runtime.epoch
                        if not m.recent:
                            m.recent.extend((now, 0.002, 0.3) for _ in range(RECENT_FINISHED))
                            m.finished += RECENT_FINISHED
                        m.recent.extend((now, 0.002 + i * 1e-6, 0.3) for _ in range(50))
                        m.finished += 50
                start = time.thread_time()
                sampler.sample_now()
                times.append(time.thread_time() - start)
            return statistics.median(times) * 1e6

        idle = run(False)
        busy = run(True)
        await state.stop()
        nursery.cancel_scope.cancel()
    return len(state.runtimes), idle, busy


async def stream_reader(url: str, stop: trio.Event) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    request = (f"GET /control/dashboard/events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n").encode()
    async with stream:
        await stream.send_all(request)
        with trio.move_on_at(trio.current_time() + 3600) as scope:
            while not stop.is_set():
                with trio.move_on_after(1):
                    if not await stream.receive_some(65536):
                        break
        del scope


async def pages_cost(url: str, pages: int, seconds: float) -> float:
    """The server's CPU seconds per wall second with ``pages`` streams open."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(pages):
            nursery.start_soon(stream_reader, url, stop)
        await trio.sleep(1.0)  # connected, init events sent
        before = (await get_stats(url))["process"]
        await trio.sleep(seconds)
        after = (await get_stats(url))["process"]
        stop.set()
        nursery.cancel_scope.cancel()
    cpu = after["cpu_seconds"] - before["cpu_seconds"]
    wall = after["monotonic_seconds"] - before["monotonic_seconds"]
    return cpu / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="window per page count")
    parser.add_argument("--ticks", type=int, default=400, help="sampler ticks per case")
    args = parser.parse_args()
    models, idle, busy = trio.run(sampler_cost, args.ticks)
    per_s = 1 / SAMPLE_INTERVAL
    print(f"sampler: {models} models, {per_s:g} samples/s each")
    print(f"  CPU per tick, idle: {idle:8.1f} µs  ({idle * per_s / 1e4:.3f} % of a core)")
    print(f"  CPU per tick, busy: {busy:8.1f} µs  ({busy * per_s / 1e4:.3f} % of a core)")
    with ServerProcess(["--config", "gpt-oss-20b"]) as server:
        base = trio.run(pages_cost, server.url, 0, args.seconds)
        print(f"server, 1 model, idle: {base * 100:.2f} % of a core with no page open")
        for pages in (1, 10, 50):
            load = trio.run(pages_cost, server.url, pages, args.seconds)
            extra = (load - base) * 100
            print(
                f"  {pages:3d} pages: {load * 100:6.2f} % of a core "
                f"(+{extra:.2f} %, {extra / pages:.3f} % per page)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
