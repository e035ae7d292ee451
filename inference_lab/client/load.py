"""The load generator behind ``inference-lab load``: closed loop, open loop, adaptive (AIMD);
its values (``LoadConfig``, the records, the result) are in :mod:`.load_records`.

Rule 1: one dispatcher task starts every request, into one nursery of request tasks. A
  ``trio.CapacityLimiter`` gates it: ``concurrency`` tokens in a closed loop,
  ``max_concurrency`` (or unlimited) in an open loop, the AIMD limit in adaptive mode —
  resized through ``total_tokens``, which lets requests in flight finish and only gates new
  ones.
Rule 2: everything is bounded. Dispatching stops at ``duration`` (a cancel scope) or after
  ``requests`` requests; each request is cut at ``request_timeout``; with ``duration``, any
  request still running at ``duration + drain_timeout`` is cancelled; a 529'd request is
  retried at most ``max_retries`` times.
Rule 3: a request's end is handled synchronously in its own task — update the controller
  and the limit (``_settle``), then build the record, queue a retry, release the slot and
  hand the record to the results channel (``_finish``) — with no checkpoint in between, so
  the dispatcher never starts a request against a limit that has not yet seen every
  outcome that freed a slot. A slot that must stay taken after its answer (a connection
  error; a ``Retry-After`` with ``retry_after``) is settled first, held, then finished.
Rule 4: records leave through a memory channel to one collector task (progress callback,
  time series); a sampler task snapshots limit, in-flight count, 529 rate and latency.
Rule 5: it connects only to the origin in ``url`` (``http.py``, Rule 1).
Rule 6: before the clock starts it opens one connection and (``check_model``) asks
  ``GET /v1/models`` whether ``model`` is served: an unreachable server or an unknown
  model is one ``LoadError``, never a run of identical failures.
Rule 7: with ``retry_after``, a 429, 503 or 529 carrying ``Retry-After`` keeps its slot
  for the seconds asked (at most ``RETRY_AFTER_CAP``, and never past the end of
  dispatching), so the closed-loop worker or the adaptive retry behind it waits; without
  the header the slot is freed at once, as without the option.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

import h11
import numpy as np
import trio

from .aimd import AIMDController
from .http import (
    Connect,
    Connection,
    ConnectionFailed,
    ConnectionPool,
    connect_tcp,
    parse_base_url,
)
from .load_records import (
    OUTCOMES,
    Attempt,
    LoadConfig,
    LoadError,
    LoadResult,
    Outcome,
    RequestRecord,
    Sample,
    status_outcome,
)
from .sse import SSEParser
from .wire import (
    PACING_LAG_HEADER,
    StreamAccumulator,
    build_prompt,
    encode_request,
    endpoint_path,
    models_path,
    parse_completion_body,
    parse_error_body,
    parse_model_ids,
    parse_pacing_lag,
    parse_retry_after,
)

__all__ = [
    "OUTCOMES",
    "RETRY_AFTER_CAP",
    "RETRY_AFTER_STATUSES",
    "LoadConfig",
    "LoadError",
    "LoadResult",
    "Outcome",
    "RequestRecord",
    "Sample",
    "run_load",
]

CONNECTION_ERROR_PAUSE = 0.1
"""Seconds a request slot stays taken after a connection error (see ``_request_task``)."""

RATE_WINDOW = 1.0
"""Seconds of recent completions each time-series sample summarises."""

RETRY_AFTER_CAP = 60.0
"""The longest wait a ``Retry-After`` gets with ``retry_after`` (seconds; the simulated
server never asks for more)."""

RETRY_AFTER_STATUSES = (429, 503, 529)
"""The answers whose ``Retry-After`` ``retry_after`` honours."""

MODELS_SHOWN = 20
"""At most this many served models are named in the unknown-model error."""

_ERROR_BODY_LIMIT = 1 << 20
_BODY_LIMIT = 64 << 20


async def run_load(
    config: LoadConfig,
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
    on_sample: Callable[[Sample], None] | None = None,
    stop: trio.Event | None = None,
    connect: Connect = connect_tcp,
) -> LoadResult:
    """Run one load and return its records and time series.

    Raises ``LoadError`` if the server cannot be reached before the run starts, or (with
    ``check_model``) does not list the model (Rule 6). Setting
    ``stop`` ends the run at once (requests in flight are cancelled and recorded as such),
    which is how the CLI turns Ctrl-C into a partial report. The callbacks run in the
    collector and sampler tasks; they must not block. ``connect`` opens each connection to
    the ``url``'s origin (``http.connect_tcp`` by default; tests pass in-memory streams and
    run the whole load on trio's ``MockClock``).
    """
    run = _Run(config, on_record, on_sample, connect)
    try:
        return await run.run(stop)
    finally:
        run.pool.close()


class _Run:
    def __init__(
        self,
        config: LoadConfig,
        on_record: Callable[[RequestRecord], None] | None,
        on_sample: Callable[[Sample], None] | None,
        connect: Connect,
    ) -> None:
        self.cfg = config
        origin = parse_base_url(config.url)
        self.pool = ConnectionPool(origin, connect=connect)
        self.target = endpoint_path(origin.base_path, config.endpoint)
        self.headers = [
            ("host", origin.authority),
            ("content-type", "application/json"),
            ("accept", "text/event-stream" if config.stream else "application/json"),
            ("user-agent", "inference-lab-load/0.1"),
        ]
        self.body = encode_request(
            model=config.model,
            endpoint=config.endpoint,
            prompt=build_prompt(config.prompt_tokens, config.endpoint),
            max_tokens=config.max_tokens,
            stream=config.stream,
        )
        self.on_record = on_record
        self.on_sample = on_sample
        self.controller: AIMDController | None = None
        if config.mode == "adaptive":
            self.controller = AIMDController(
                initial=config.start_limit,
                max_limit=config.ceiling,
                window=config.window,
                backoff=config.backoff,
            )
            limit: float = self.controller.limit
        elif config.mode == "closed":
            assert config.concurrency is not None
            limit = config.concurrency
        else:
            limit = config.max_concurrency if config.max_concurrency is not None else math.inf
        self.limiter = trio.CapacityLimiter(limit)
        self.limit_changes: list[tuple[float, int]] = []
        self.t0 = 0.0
        self.in_flight = 0
        self.holding = 0  # slots still taken after their answer (Rule 3)
        self.dispatch_over = trio.Event()  # set when no request will be started any more
        self.issued = 0  # logical requests started
        self.next_index = 0
        self.retries: collections.deque[tuple[int, int]] = collections.deque()
        self.changed = trio.Event()
        self.dispatching = True
        self.records: list[RequestRecord] = []
        self.recent: collections.deque[RequestRecord] = collections.deque()
        self.samples: list[Sample] = []
        self.send_channel, self.receive_channel = trio.open_memory_channel[RequestRecord](math.inf)

    # -- orchestration -------------------------------------------------------------------

    async def run(self, stop: trio.Event | None) -> LoadResult:
        cfg = self.cfg
        await self._preflight()
        started_at = time.time()
        self.t0 = t0 = trio.current_time()
        if self.controller is not None:
            self.limit_changes.append((0.0, self.controller.limit))
        dispatch_end: float | None = None
        collected = trio.Event()
        async with trio.open_nursery() as outer:
            outer.start_soon(self._collect, collected)
            outer.start_soon(self._sampler)
            with self.send_channel, trio.CancelScope() as hard:
                if cfg.duration is not None:
                    hard.deadline = t0 + cfg.duration + cfg.drain_timeout
                if stop is not None:
                    outer.start_soon(self._watch_stop, stop, hard)
                async with trio.open_nursery() as workers:
                    deadline = t0 + cfg.duration if cfg.duration is not None else math.inf
                    with trio.move_on_at(deadline):
                        await self._dispatch(workers)
                    self.dispatching = False
                    self.dispatch_over.set()
                    dispatch_end = trio.current_time() - t0
            self.dispatching = False
            end = trio.current_time() - t0
            await collected.wait()
            outer.cancel_scope.cancel()
        return LoadResult(
            config=cfg,
            started_at=started_at,
            dispatch_end=end if dispatch_end is None else min(dispatch_end, end),
            end=end,
            records=tuple(sorted(self.records, key=lambda r: r.index)),
            samples=tuple(self.samples),
            limit_changes=tuple(self.limit_changes),
            controller=self.controller.statistics() if self.controller else None,
            pool=self.pool.statistics(),
            interrupted=stop is not None and stop.is_set(),
        )

    async def _preflight(self) -> None:
        """Open the first connection before the clock starts and (``check_model``) read
        the model list on it (Rule 6): an unreachable server or a model it does not serve
        is a one-line error, not a run full of identical failures."""
        origin = self.pool.origin
        try:
            with trio.fail_after(self.cfg.connect_timeout):
                conn = await self.pool.acquire()
                if self.cfg.check_model:
                    try:
                        await self._check_model(conn)
                    except BaseException:
                        conn.close()
                        raise
        except ConnectionFailed as exc:
            raise LoadError(str(exc)) from None
        except trio.TooSlowError:
            raise LoadError(f"cannot connect to {origin}: timed out") from None
        self.pool.release(conn)

    async def _check_model(self, conn: Connection) -> None:
        origin = self.pool.origin
        target = models_path(origin.base_path)
        headers = [
            ("host", origin.authority),
            ("accept", "application/json"),
            ("user-agent", "inference-lab-load/0.1"),
        ]
        await conn.send_request("GET", target, headers, b"")
        response = await conn.receive_response()
        body = await conn.read_body(_BODY_LIMIT)
        where = f"GET http://{origin.authority}{target}"
        skip = "(--no-model-check sends the requests anyway)"
        if response.status_code != 200:
            etype, code, message = parse_error_body(body)
            detail = ": ".join(x for x in (code or etype, message) if x)
            raise LoadError(
                f"{where} answered {response.status_code}"
                + (f" ({detail})" if detail else "")
                + f" {skip}"
            )
        served = parse_model_ids(body)
        if served is None:
            raise LoadError(f"{where} did not answer a model list {skip}")
        if self.cfg.model not in served:
            names = ", ".join(served[:MODELS_SHOWN]) or "none"
            more = f" and {len(served) - MODELS_SHOWN} more" if len(served) > MODELS_SHOWN else ""
            raise LoadError(
                f"model {self.cfg.model!r} is not served by {origin} (it serves: {names}{more})"
            )

    async def _watch_stop(self, stop: trio.Event, hard: trio.CancelScope) -> None:
        await stop.wait()
        hard.cancel()

    # -- dispatch ------------------------------------------------------------------------

    async def _dispatch(self, workers: trio.Nursery) -> None:
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed) if cfg.rate is not None else None
        next_arrival = 0.0
        while True:
            if rng is not None:
                if cfg.requests is not None and self.issued >= cfg.requests:
                    return
                assert cfg.rate is not None
                next_arrival += float(rng.exponential(1.0 / cfg.rate))
                await trio.sleep_until(self.t0 + next_arrival)
            borrower = object()
            await self.limiter.acquire_on_behalf_of(borrower)
            job = self._take_job()
            if job is None:
                self.limiter.release_on_behalf_of(borrower)
                if self.controller is None or self.in_flight + self.holding == 0:
                    return  # nothing will be retried: the count is spent
                # Adaptive: a request in flight may still come back 529 and need a retry.
                self.changed = trio.Event()
                await self.changed.wait()
                continue
            request, attempt = job
            index = self.next_index
            self.next_index += 1
            self.in_flight += 1
            workers.start_soon(self._request_task, borrower, index, request, attempt)

    def _take_job(self) -> tuple[int, int] | None:
        if self.retries:
            return self.retries.popleft()
        if self.cfg.requests is not None and self.issued >= self.cfg.requests:
            return None
        self.issued += 1
        return self.issued - 1, 0

    # -- one request ---------------------------------------------------------------------

    async def _request_task(self, borrower: object, index: int, request: int, attempt: int) -> None:
        att = Attempt(index, request, attempt, trio.current_time())
        try:
            with trio.move_on_after(self.cfg.request_timeout) as scope:
                await self._exchange(att)
            if scope.cancelled_caught:
                att.fail("timeout", "timeout", None, f"no answer in {self.cfg.request_timeout} s")
            if att.outcome == "connection_error":
                # A server that is gone refuses connections in microseconds; holding the
                # slot a moment keeps a closed loop from spinning (and its records from
                # piling up) until the run ends.
                await self._hold(att, CONNECTION_ERROR_PAUSE, until_dispatch_over=False)
            elif self.cfg.retry_after and att.retry_after is not None:
                await self._hold(att, min(att.retry_after, RETRY_AFTER_CAP), retry_wait=True)
        except trio.Cancelled:
            if att.ended is None:
                att.fail("cancelled", "cancelled")
            raise
        finally:
            self._finish(borrower, att)

    async def _hold(
        self,
        att: Attempt,
        seconds: float,
        *,
        until_dispatch_over: bool = True,
        retry_wait: bool = False,
    ) -> None:
        """Keep the slot taken ``seconds`` after the answer (Rule 3: the controller sees the
        outcome first); with ``until_dispatch_over`` the hold ends when dispatching does,
        as nothing would use the slot. ``retry_wait`` records the time held (Rule 7)."""
        att.ended = now = trio.current_time()
        self._settle(att)
        self.holding += 1
        try:
            with trio.move_on_at(now + seconds):
                if until_dispatch_over:
                    await self.dispatch_over.wait()
                else:
                    await trio.sleep_forever()
        finally:
            self.holding -= 1
            if retry_wait:
                att.retry_wait = trio.current_time() - now

    async def _exchange(self, att: Attempt) -> None:
        conn: Connection | None = None
        try:
            conn, response = await self._send()
            att.status = status = response.status_code
            for name, value in response.headers:
                if name == PACING_LAG_HEADER:
                    att.pacing_lag = parse_pacing_lag(value)
            if status != 200:
                etype, code, message = parse_error_body(await conn.read_body(_ERROR_BODY_LIMIT))
                outcome = status_outcome(status)
                default_type = "overloaded_error" if status == 529 else f"http_{status}"
                att.fail(outcome, etype or default_type, code, message)
                if status in RETRY_AFTER_STATUSES:
                    for name, value in response.headers:
                        if name == b"retry-after":
                            att.retry_after = parse_retry_after(value, time.time())
            elif self.cfg.stream:
                await self._read_stream(conn, att)
            else:
                body = await conn.read_body(_BODY_LIMIT)
                prompt, completion, finish, ok = parse_completion_body(body)
                att.prompt_tokens = prompt
                att.completion_tokens = completion
                att.finish_reason = finish
                if ok:
                    att.outcome = "ok"
                else:
                    att.fail("stream_error", "invalid_response", None, "body is not a completion")
            self.pool.release(conn)
            conn = None
        except ConnectionFailed as exc:
            att.fail("connection_error", "connection_error", None, str(exc))
        finally:
            if conn is not None:
                conn.close()

    async def _send(self) -> tuple[Connection, h11.Response]:
        """Send the request and read the response head; return the connection and it.

        If writing to an idle keep-alive connection fails, the server had closed it and never
        saw this request, so it goes out once more on the next connection. A failure after
        the request was written is not retried (the server may have taken it). On failure
        the connection is closed before the exception propagates."""
        while True:
            conn = await self.pool.acquire()
            try:
                await conn.send_request("POST", self.target, self.headers, self.body)
            except ConnectionFailed:
                conn.close()
                if conn.reused:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            try:
                response = await conn.receive_response()
            except BaseException:
                conn.close()
                raise
            return conn, response

    async def _read_stream(self, conn: Connection, att: Attempt) -> None:
        # The hot loop: per socket read one h11 pass, one SSE feed, one clock read.
        parser = SSEParser()
        acc = StreamAccumulator()
        times = att.token_times
        started = att.started
        clock = trio.current_time
        while True:
            data, ended = await conn.receive_body_chunk()
            if data:
                n = 0
                for event in parser.feed(data):
                    n += acc.feed(event.data)
                if n:
                    t = clock() - started
                    if n == 1:
                        times.append(t)
                    else:
                        times.extend([t] * n)
            if ended:
                break
        att.prompt_tokens = acc.prompt_tokens
        att.completion_tokens = acc.completion_tokens
        att.finish_reason = acc.finish_reason
        if acc.error_type is not None:
            att.fail("stream_error", acc.error_type, acc.error_code, acc.error_message)
        elif not acc.done:
            att.fail("stream_error", "incomplete_stream", None, "stream ended without [DONE]")
        else:
            att.outcome = "ok"

    def _settle(self, att: Attempt) -> None:
        """Rule 3, first half: the attempt leaves the in-flight count and the controller
        (and so the limit) sees its outcome. Synchronous; runs once per attempt."""
        if att.settled:
            return
        att.settled = True
        self.in_flight -= 1
        controller = self.controller
        if controller is not None:
            before = controller.limit
            controller.on_outcome(att.outcome)
            if controller.limit != before:
                self.limiter.total_tokens = controller.limit
                self.limit_changes.append((trio.current_time() - self.t0, controller.limit))

    def _finish(self, borrower: object, att: Attempt) -> None:
        """Rule 3: synchronous, runs exactly once per attempt, also when cancelled."""
        now = trio.current_time()
        self._settle(att)
        record = att.record(self.t0, now if att.ended is None else att.ended)
        if (
            self.controller is not None
            and record.outcome == "overloaded"
            and self.dispatching
            and record.attempt < self.cfg.max_retries
        ):
            self.retries.append((record.request, record.attempt + 1))
        self.limiter.release_on_behalf_of(borrower)
        self.changed.set()
        self.send_channel.send_nowait(record)

    # -- results -------------------------------------------------------------------------

    async def _collect(self, done: trio.Event) -> None:
        async with self.receive_channel:
            async for record in self.receive_channel:
                self.records.append(record)
                self.recent.append(record)
                if self.on_record is not None:
                    self.on_record(record)
        done.set()

    async def _sampler(self) -> None:
        interval = self.cfg.sample_interval
        k = 1
        while True:
            await trio.sleep_until(self.t0 + k * interval)
            k += 1
            self.samples.append(self._sample())
            if self.on_sample is not None:
                self.on_sample(self.samples[-1])

    def _sample(self) -> Sample:
        now = trio.current_time() - self.t0
        recent = self.recent
        while recent and recent[0].end < now - RATE_WINDOW:
            recent.popleft()
        ok = [r for r in recent if r.outcome == "ok"]
        overloaded = sum(1 for r in recent if r.outcome == "overloaded")
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        total = self.limiter.total_tokens
        return Sample(
            time=now,
            limit=None if total == math.inf else int(total),
            in_flight=self.in_flight,
            completed=len(recent),
            ok=len(ok),
            overloaded=overloaded,
            overload_rate=overloaded / len(recent) if recent else 0.0,
            e2e_mean=sum(r.e2e for r in ok) / len(ok) if ok else None,
            ttft_mean=sum(ttfts) / len(ttfts) if ttfts else None,
        )
