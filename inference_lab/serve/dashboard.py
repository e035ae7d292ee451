"""The live dashboard: ``GET /control/dashboard`` and the event stream it reads.

One :class:`Sampler` per app samples every served model every :data:`SAMPLE_INTERVAL`
seconds -- running and queued requests, KV usage, admitted / refused / aborted requests and
output tokens per second, TTFT and E2E percentiles over a sliding window, pacing lag, the
capacity dials and their changes -- and keeps each model's samples in a bounded ring.
``GET /control/dashboard`` is one self-contained page (:mod:`inference_lab.web`); it reads
``GET /control/dashboard/events?model=NAME``, a Server-Sent Events stream.

Rule 1: one sampler task per app, started in the app's serving nursery after the runtimes
        and stopped after them; it does all the work: each sample is computed and encoded
        once, and every connected page is sent those bytes. Nothing is computed per client.
Rule 2: data is pushed, never polled: a stream parks until the sampler's next tick and
        then sends the frames it has not sent yet. Memory is bounded: a model keeps
        :data:`RING_SAMPLES` samples; a stream that fell behind the ring resumes at its
        oldest sample.
Rule 3: the sampler reads only what is published or counted already: runtime snapshots,
        the metrics recorder's counters and recent completions
        (:class:`~inference_lab.serve.metrics.ModelMetrics`), the runtimes' capacity
        change logs, and one ``engine.statistics()`` per live model per tick.
Rule 4: every dashboard path is under ``/control/``, so the control plane's gate guards it
        (loopback, or the control token: ``Authorization: Bearer`` or, for a browser,
        ``?token=``); ``--no-dashboard`` registers none of its routes (404) and starts no
        sampler.
Rule 5: when the sampler stops (the server shuts down) every stream sends an ``end`` event
        and finishes its body: no page is left hanging on a dead connection.
Rule 6: a model whose engine is not running is sampled with ``alive`` false and nothing
        running, queued or in the KV cache (its requests get 503); the page says so.
Rule 7: a page that names no model is shown the busiest (:meth:`Sampler.busiest`): the
        most requests running and queued now, then the most admitted since start, then the
        first served; an idle server opens on its first model.
Rule 8: each sample carries the pacing lag's p99 over the last complete second
        (``lag_p99_ms``, 0 after a quiet second) and ``host_behind``, true when it
        passes the threshold of the server's "not keeping up" log warning
        (:data:`~inference_lab.runtime.lag.LAG_WARN_P99`, ``lag_warn_ms`` in the page's
        settings): the page's banner then says the host, not the model, sets the
        latencies clients see.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import attrs
import numpy as np
import numpy.ma  # noqa: F401  (see below)
import trio
from quart import Response, request
from quart_trio import QuartTrio

from inference_lab.jsonbytes import dumps
from inference_lab.runtime.lag import LAG_WARN_P99
from inference_lab.runtime.model_runtime import ModelRuntime, RuntimeSnapshot
from inference_lab.serve.error_replies import error_reply
from inference_lab.serve.metrics import RECENT_FINISHED, ModelMetrics
from inference_lab.serve.routes import to_response
from inference_lab.serve.state import ServeState
from inference_lab.web import Page, page

__all__ = [
    "LATENCY_WINDOW",
    "RATE_WINDOW",
    "RING_SAMPLES",
    "SAMPLE_INTERVAL",
    "Sampler",
    "dashboard_page",
    "register_dashboard_routes",
]

#: Seconds between two samples.
SAMPLE_INTERVAL = 0.25
#: Samples kept per model (5 minutes at the interval).
RING_SAMPLES = 1200
#: Rates (per second) are over this many seconds of samples.
RATE_WINDOW = 1.0
#: TTFT and E2E percentiles are over the requests that finished in this many seconds (at
#: most the newest ``RECENT_FINISHED`` of them, about that many more at a burst's end).
LATENCY_WINDOW = 10.0
#: Capacity changes sent to a page that connects (the newest).
CHANGES_KEPT = 256
#: The latency percentiles of a sample.
PERCENTILES = (50, 90, 99)
# np.percentile's first call imports numpy.ma (np.unique reaches it lazily): 30-110 ms
# that would stall a running server's pacing loop at its first sampler tick with latencies,
# so this module imports it when it is loaded (above).


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


@attrs.define(kw_only=True)
class _Counters:
    """One model's cumulative counters at one tick, for rates."""

    t: float
    admitted: int
    refused: int
    unavailable: int
    aborted: int
    finished: int
    tokens: int


@attrs.define(eq=False, kw_only=True)
class _ModelTrack:
    """What the sampler keeps for one model between ticks."""

    name: str
    runtime: ModelRuntime | None = None  # the runtime sampled last (a restart replaces it)
    ring: deque[tuple[int, bytes]] = attrs.field(factory=lambda: deque(maxlen=RING_SAMPLES))
    history: deque[_Counters] = attrs.field(factory=deque)
    #: the latency window: one array of (finish, TTFT, E2E) rows in engine seconds per
    #: tick that saw completions, oldest first, and how many rows they hold
    window: deque[np.ndarray[Any, np.dtype[np.float64]]] = attrs.field(factory=deque)
    window_size: int = 0
    finished_seen: int = 0
    percentiles: dict[str, float | None] = attrs.field(factory=dict)
    changes: deque[dict[str, Any]] = attrs.field(factory=lambda: deque(maxlen=CHANGES_KEPT))
    changes_seen: int = 0
    # the last tick's runtime counters (they restart with a restarted runtime)
    base_admitted: int = 0
    base_refused: int = 0
    base_aborted: int = 0
    admitted: int = 0
    refused: int = 0
    aborted: int = 0
    lag_total: float = 0.0
    lag_events: int = 0
    hits: int = 0
    queries: int = 0


class Sampler:
    """Samples every model of one app (module rules). :meth:`run` is started once in the
    app's serving nursery; :meth:`stop` ends it and every stream."""

    def __init__(self, state: ServeState, interval: float = SAMPLE_INTERVAL) -> None:
        self.state = state
        self.interval = interval
        self.tracks = {name: _ModelTrack(name=name) for name in state.runtimes}
        self.seq = 0  # samples taken (each tick takes one per model)
        self.started = 0.0  # trio time of the first tick
        self.started_unix = 0.0  # the same moment on the wall clock (for the page's axis)
        self.closed = False
        self.streams = 0  # connected event streams
        self._tick = trio.Event()
        self._cancel: trio.CancelScope | None = None
        #: CPU seconds spent taking samples, and how many ticks (for benchmarks)
        self.cpu_seconds = 0.0
        self.ticks = 0

    # -- the sampler task ----------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take a sample of every model every interval until :meth:`stop`."""
        self.started = trio.current_time()
        self.started_unix = time.time()
        with trio.CancelScope() as scope:
            self._cancel = scope
            task_status.started()
            deadline = self.started
            while not self.closed:
                self.sample_now()
                deadline += self.interval
                now = trio.current_time()
                if deadline < now:  # a stalled loop: take up the rhythm from now
                    deadline = now + self.interval
                await trio.sleep_until(deadline)
        self._close()

    def stop(self) -> None:
        """End the sampler and every stream (each sends ``end``). Idempotent."""
        self._close()
        if self._cancel is not None:
            self._cancel.cancel()

    def _close(self) -> None:
        self.closed = True
        self._tick.set()

    async def wait_tick(self, seq: int) -> None:
        """Return once a sample newer than ``seq`` was taken or the sampler stopped."""
        while self.seq <= seq and not self.closed:
            await self._tick.wait()

    def sample_now(self) -> None:
        """Sample every model once and wake the streams (the sampler task's tick)."""
        cpu = time.thread_time()
        now = trio.current_time()
        self.seq += 1
        for name, track in self.tracks.items():
            runtime = self.state.runtimes.get(name)
            metrics = self.state.metrics.models.get(name)
            if runtime is None or metrics is None:
                continue
            sample = self._sample(track, runtime, metrics, now)
            track.ring.append((self.seq, b"event: sample\ndata: " + dumps(sample) + b"\n\n"))
        tick, self._tick = self._tick, trio.Event()
        tick.set()
        self.ticks += 1
        self.cpu_seconds += time.thread_time() - cpu

    def _sample(
        self, track: _ModelTrack, runtime: ModelRuntime, metrics: ModelMetrics, now: float
    ) -> dict[str, Any]:
        snap = runtime.snapshot()
        t = now - self.started
        counters = _count(track, snap, runtime, metrics, t)
        first = track.history[0]
        span = t - first.t

        def rate(field: str) -> float:
            if span <= 0:
                return 0.0
            delta: int = getattr(counters, field) - getattr(first, field)
            return round(delta / span, 3)

        kv_usage, hit_rate = _kv_sample(track, snap, runtime)
        lag_total, lag_events = metrics.lag.total, metrics.lag_events
        lag_n = lag_events - track.lag_events
        lag_mean = (lag_total - track.lag_total) / lag_n if lag_n > 0 else 0.0
        track.lag_total, track.lag_events = lag_total, lag_events
        lag_peak, metrics.lag_peak = metrics.lag_peak, 0.0
        lag_p99 = runtime.recent_lag_p99() if snap.alive else 0.0
        sample: dict[str, Any] = {
            "seq": self.seq,
            "t": round(t, 4),
            "alive": snap.alive,
            "draining": self.state.draining,
            "running": snap.running,
            "queued": snap.queued,
            "waiting_places": snap.depth,
            "max_num_seqs": snap.max_num_seqs,
            "max_waiting": snap.max_waiting,
            "kv_usage": round(kv_usage, 5),
            "prefix_hit_rate": hit_rate,
            "admitted_per_s": rate("admitted"),
            "refused_per_s": rate("refused"),
            "unavailable_per_s": rate("unavailable"),
            "aborted_per_s": rate("aborted"),
            "finished_per_s": rate("finished"),
            "tokens_per_s": rate("tokens"),
            "admitted": track.admitted,
            "refused": track.refused,
            "aborted": track.aborted,
            "lag_mean_ms": _ms(lag_mean),
            "lag_max_ms": _ms(lag_peak),
            "lag_p99_ms": _ms(lag_p99),
            "host_behind": lag_p99 > LAG_WARN_P99,
        }
        sample.update(self._latencies(track, runtime, metrics))
        changes = self._new_changes(track, runtime)
        if changes:
            sample["changes"] = changes
        return sample

    def _latencies(
        self, track: _ModelTrack, runtime: ModelRuntime, metrics: ModelMetrics
    ) -> dict[str, Any]:
        """TTFT and E2E percentiles (ms) over the requests that finished in the last
        :data:`LATENCY_WINDOW` seconds of engine time; recomputed only when the window
        changed. The window is a deque of per-tick arrays (finish, TTFT, E2E), so a tick
        converts only its own completions and drops whole arrays as they age."""
        chunks = track.window
        new = metrics.finished - track.finished_seen
        track.finished_seen = metrics.finished
        changed = False
        if new > 0:
            recent = metrics.recent
            take = min(new, len(recent))
            start = len(recent) - take
            chunk = np.array([recent[i] for i in range(start, len(recent))], dtype=np.float64)
            chunks.append(chunk)
            track.window_size += take
            changed = True
        # engine time runs with the wall clock from the runtime's epoch (an idle engine's
        # own clock stands still)
        horizon = trio.current_time() - runtime.epoch - LATENCY_WINDOW
        while chunks and chunks[0][-1, 0] < horizon:  # every one of its requests aged
            track.window_size -= len(chunks.popleft())
            changed = True
        while len(chunks) > 1 and track.window_size - len(chunks[0]) >= RECENT_FINISHED:
            track.window_size -= len(chunks.popleft())  # bounded: the newest completions
            changed = True
        if chunks and chunks[0][0, 0] < horizon:  # some of the oldest array aged
            oldest = chunks[0]
            keep = oldest[oldest[:, 0] >= horizon]
            track.window_size -= len(oldest) - len(keep)
            chunks[0] = keep
            changed = True
        if changed or not track.percentiles:
            out: dict[str, float | None] = {"latency_n": track.window_size}
            if chunks:
                values = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
                for column, name in ((1, "ttft"), (2, "e2e")):
                    qs = np.percentile(values[:, column], PERCENTILES)
                    for p, q in zip(PERCENTILES, qs, strict=True):
                        out[f"{name}_p{p}_ms"] = _ms(float(q))
            else:
                for name in ("ttft", "e2e"):
                    for p in PERCENTILES:
                        out[f"{name}_p{p}_ms"] = None
            track.percentiles = out
        return track.percentiles

    def _new_changes(self, track: _ModelTrack, runtime: ModelRuntime) -> list[dict[str, Any]]:
        """The capacity changes made since the last tick, on the samples' time axis."""
        count = runtime.capacity_change_count
        new = count - track.changes_seen
        if new <= 0:
            return []
        track.changes_seen = count
        log = runtime.capacity_changes
        out = []
        for i in range(max(0, len(log) - new), len(log)):
            change = log[i]
            entry = {
                "t": round(change.time - self.started, 4),
                "max_num_seqs": change.max_num_seqs,
                "max_waiting": change.max_waiting,
            }
            track.changes.append(entry)
            out.append(entry)
        return out

    def busiest(self) -> str:
        """Rule 7: the model a page without ``?model=`` opens on. Reads each runtime's
        published snapshot (no work); called once per event stream that names no model."""
        best, best_key = next(iter(self.tracks)), (-1, -1)
        for name in self.tracks:
            runtime = self.state.runtimes.get(name)
            if runtime is None:
                continue
            snap = runtime.snapshot()
            key = (snap.running + snap.queued, snap.admitted)
            if key > best_key:  # strictly: the first served wins a tie
                best, best_key = name, key
        return best

    # -- what a stream sends -----------------------------------------------------------
    def init_frame(self, name: str) -> tuple[bytes, int]:
        """A new stream's first event: the page's settings, the model's samples so far
        and its capacity changes; and the sequence number it covers."""
        track = self.tracks[name]
        history = b",".join(frame[len(b"event: sample\ndata: ") : -2] for _, frame in track.ring)
        head = dumps(
            {
                "model": name,
                "models": list(self.tracks),
                "interval": self.interval,
                "rate_window": RATE_WINDOW,
                "latency_window": LATENCY_WINDOW,
                "ring_samples": RING_SAMPLES,
                "lag_warn_ms": _ms(LAG_WARN_P99),
                "started_unix": self.started_unix,
                "changes": list(track.changes),
            }
        )
        body = head[:-1] + b',"history":[' + history + b"]}"
        return b"event: init\ndata: " + body + b"\n\n", self.seq

    def frames_after(self, name: str, seq: int) -> tuple[bytes, int]:
        """The model's sample frames newer than ``seq`` (from the oldest kept, for a
        stream that fell behind the ring), and the newest sequence number sent."""
        ring = self.tracks[name].ring
        out = [frame for s, frame in ring if s > seq] if ring and ring[-1][0] > seq else []
        return b"".join(out), self.seq

    async def stream(self, name: str) -> AsyncIterator[bytes]:
        """One page's event stream (Rules 2 and 5)."""
        self.streams += 1
        try:
            frame, seq = self.init_frame(name)
            yield frame
            while not self.closed:
                await self.wait_tick(seq)
                data, seq = self.frames_after(name, seq)
                if data:
                    yield data
            yield b'event: end\ndata: {"reason":"the server is shutting down"}\n\n'
        finally:
            self.streams -= 1


def dashboard_page() -> Page:
    """The dashboard's HTML and its Content-Security-Policy."""
    return page(
        "dashboard.html",
        scripts=("uPlot.iife.min.js", "charts.js", "dashboard.js"),
        styles=("uPlot.min.css", "pages.css"),
        title="inference-lab dashboard",
    )


_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


def register_dashboard_routes(app: QuartTrio, sampler: Sampler) -> None:
    """``GET /control/dashboard`` and ``GET /control/dashboard/events`` (Rule 4: under
    the control plane's gate)."""
    built = dashboard_page()
    html = built.html.encode()

    @app.get("/control/dashboard")
    async def dashboard() -> Response:
        response = Response(html, status=200, content_type="text/html; charset=utf-8")
        response.headers.update(_SECURITY_HEADERS)
        response.headers["Content-Security-Policy"] = built.csp
        return response

    @app.get("/control/dashboard/events")
    async def events() -> Response:
        name = request.args.get("model") or sampler.busiest()
        if name not in sampler.tracks:
            return to_response(error_reply(sampler.state.model_not_found(name)))
        response = Response(sampler.stream(name), status=200, content_type="text/event-stream")
        response.headers.update(_SECURITY_HEADERS)
        response.headers["X-Accel-Buffering"] = "no"  # a proxy in front: do not buffer
        response.timeout = None  # Quart would cut a response at 60 s
        return response


def _count(
    track: _ModelTrack,
    snap: RuntimeSnapshot,
    runtime: ModelRuntime,
    metrics: ModelMetrics,
    t: float,
) -> _Counters:
    """The model's counters at ``t`` (seconds since the sampler started), added to its
    history, which keeps :data:`RATE_WINDOW` seconds of them (a fresh runtime's counters
    continue its predecessor's)."""
    if track.runtime is not runtime:
        # a fresh runtime (the first tick, or a harness restart): its own counters
        # start at 0, so they are added to what the old one counted
        track.runtime = runtime
        track.base_admitted, track.base_refused, track.base_aborted = (
            track.admitted,
            track.refused,
            track.aborted,
        )
        track.changes_seen = 0
    track.admitted = track.base_admitted + snap.admitted
    track.refused = track.base_refused + snap.refused
    track.aborted = track.base_aborted + snap.aborted
    counters = _Counters(
        t=t,
        admitted=track.admitted,
        refused=track.refused,
        unavailable=metrics.rejected.get("engine_unavailable", 0),
        aborted=track.aborted,
        finished=metrics.finished,
        tokens=metrics.tokens_emitted,
    )
    history = track.history
    history.append(counters)
    while len(history) > 2 and history[1].t <= t - RATE_WINDOW:
        history.popleft()
    return counters


def _kv_sample(
    track: _ModelTrack, snap: RuntimeSnapshot, runtime: ModelRuntime
) -> tuple[float, float | None]:
    """The KV cache's usage and the prefix cache's hit rate since the last sample (None:
    no query since, or no prefix caching); 0 and None for a stopped engine."""
    kv_usage = 0.0
    hit_rate: float | None = None
    if snap.alive:
        stats = runtime.engine.statistics()
        kv_usage = stats.kv_usage
        if stats.prefix_caching:
            queries = stats.prefix_cache_queries - track.queries
            hits = stats.prefix_cache_hits - track.hits
            if queries > 0:
                hit_rate = round(hits / queries, 4)
            track.queries, track.hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    return kv_usage, hit_rate
