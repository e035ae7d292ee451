"""Replaying traffic against a server: multi-turn sessions and trace files.

``inference-lab load --sessions FILE`` replays a session file (``inference_lab.traffic.
sessions``, written by ``inference-lab sim --write-sessions``): every turn resends the
conversation so far, so a server that caches prefixes is exercised as a chat client
exercises it, and the time to first token is reported per turn. ``--trace FILE``
replays a trace (``inference_lab.traffic.traces``) at its times.

Rule 1: a session's turns run one after another on its own task: turn ``k + 1`` is
        sent its think time after turn ``k``'s answer ended, with turn ``k``'s messages,
        the answer as it was streamed and the new user message (completions: the
        prompt, the answer and the new text, concatenated). A failed turn ends its
        session, as in the simulator.
Rule 2: sessions start at their file's start times, or with ``concurrency``, each of
        that many users takes the next session in file order when its previous one ends.
Rule 3: prompts are sized by the server's byte rule (:mod:`.wire`): ``n`` tokens are
        ``4 n`` ASCII bytes. Each text opens with a tag naming its session and turn (a
        trace request: its line; a Mooncake block: its hash id), so texts share a prefix
        exactly when the traffic says they do: a shared system prompt is the same text
        in every session, and Mooncake requests sharing leading ``hash_ids`` share their
        leading 512-token blocks of text.
Rule 4: every request streams with ``stream_options.include_usage``; a turn's record
        holds its TTFT, its end, and the usage's prompt, cached
        (``prompt_tokens_details.cached_tokens``) and completion tokens. The TTFT is
        counted from the request's bytes leaving for the socket to the arrival of the
        bytes that brought the first content frame (by the kernel's receive timestamp
        where the socket has one: ``http.py`` Rule 5), so the client's own JSON encoding
        and scheduling are not in it.
Rule 5: it connects only to the origin in ``url`` (``http.py``), and every request is
        bounded by ``request_timeout``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import attrs
import trio

from inference_lab.traffic.sessions import SessionRecord, read_sessions
from inference_lab.traffic.traces import MOONCAKE_BLOCK, Trace, TraceRequest, read_trace

from .http import (
    Connect,
    Connection,
    ConnectionFailed,
    ConnectionPool,
    connect_tcp,
    parse_base_url,
)
from .sse import SSEParser
from .wire import Endpoint, endpoint_path, models_path, parse_error_body, parse_model_ids

__all__ = [
    "ReplayConfig",
    "ReplayResult",
    "TurnRecord",
    "prompt_text",
    "run_replay",
]

_FILLER = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua ut enim ad minim veniam quis nostrud "
)
_BODY_LIMIT = 64 << 20

Outcome = Literal["ok", "http_error", "stream_error", "connection_error", "timeout", "cancelled"]


def prompt_text(tag: str, tokens: int) -> str:
    """ASCII text of ``4 * tokens`` bytes (the byte rule's ``tokens``) opening with
    ``tag``; longer only when the tag alone is (Rule 3)."""
    size = max(4 * tokens, len(tag))
    reps = size // len(_FILLER) + 2
    return (tag + _FILLER * reps)[:size]


@attrs.frozen(kw_only=True)
class ReplayConfig:
    """One replay's parameters, validated on construction (ValueError naming the flag)."""

    url: str
    model: str
    sessions: Path | None = None
    trace: Path | None = None
    concurrency: int | None = None
    endpoint: Endpoint = "chat"
    trace_format: str | None = None
    speedup: float = 1.0
    window: tuple[float, float | None] | None = None
    default_max_tokens: int = 256
    request_timeout: float = 300.0
    connect_timeout: float = 10.0
    check_model: bool = True

    def __attrs_post_init__(self) -> None:
        parse_base_url(self.url)
        if (self.sessions is None) == (self.trace is None):
            raise ValueError("give exactly one of --sessions and --trace")
        if self.concurrency is not None and self.trace is not None:
            raise ValueError("--concurrency applies to --sessions, not --trace")
        if self.trace is None and (self.speedup != 1.0 or self.window is not None):
            raise ValueError("--speedup and --trace-window apply to --trace")
        if not self.speedup > 0:
            raise ValueError("--speedup must be > 0")


@attrs.frozen(kw_only=True)
class TurnRecord:
    """One request. Times are seconds since the run started (``start``, ``end``; ``sent``:
    when its bytes were handed to the socket, None if they never were) or since it was sent
    (``ttft``: Rule 4). ``session`` and ``turn`` are -1 for a trace request (``line`` is its
    line in the trace file)."""

    session: int
    turn: int
    line: int
    start: float
    end: float
    status: int | None
    outcome: Outcome
    ttft: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    sent: float | None = None


@attrs.frozen(kw_only=True)
class ReplayResult:
    config: ReplayConfig
    started_at: float
    end: float
    records: tuple[TurnRecord, ...]
    sessions: int
    interrupted: bool


class ReplayError(Exception):
    """The replay cannot start (unreadable file, unreachable server, unknown model)."""


@attrs.define
class _Answer:
    status: int | None = None
    outcome: Outcome = "cancelled"
    sent: float | None = None
    ttft: float | None = None
    text: list[str] = attrs.field(factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    done: bool = False

    def feed(self, data: str, elapsed: float) -> None:
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            self.error = "unreadable frame"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message") if isinstance(err, dict) else err)
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _int(usage.get("prompt_tokens"))
            self.completion_tokens = _int(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.cached_tokens = _int(details.get("cached_tokens"))
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str) and piece:
                if self.ttft is None:
                    self.ttft = elapsed
                self.text.append(piece)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Replay:
    def __init__(self, config: ReplayConfig, connect: Connect) -> None:
        self.cfg = config
        origin = parse_base_url(config.url)
        self.pool = ConnectionPool(origin, connect=connect)
        self.headers = [
            ("host", origin.authority),
            ("content-type", "application/json"),
            ("accept", "text/event-stream"),
            ("user-agent", "inference-lab-load/0.1"),
        ]
        self.records: list[TurnRecord] = []
        self.t0 = 0.0

    # -- one request -----------------------------------------------------------------
    async def request(self, path: str, body: dict[str, Any]) -> tuple[_Answer, float, float]:
        """Send ``body`` to ``path`` and read the streamed answer (Rule 4)."""
        answer = _Answer()
        started = trio.current_time()
        payload = json.dumps(body, separators=(",", ":")).encode()
        with trio.move_on_after(self.cfg.request_timeout) as scope:
            await self._exchange(path, payload, answer)
        if scope.cancelled_caught:
            answer.outcome = "timeout"
            answer.error = f"no answer in {self.cfg.request_timeout} s"
        return answer, started - self.t0, trio.current_time() - self.t0

    async def _exchange(self, path: str, payload: bytes, answer: _Answer) -> None:
        conn = None
        try:
            conn = await self._send(path, payload, answer)
            response = await conn.receive_response()
            answer.status = response.status_code
            if response.status_code != 200:
                etype, code, message = parse_error_body(await conn.read_body(_BODY_LIMIT))
                answer.outcome = "http_error"
                answer.error = f"{response.status_code} {code or etype or ''}: {message or ''}"
            else:
                await self._read_stream(conn, answer)
            self.pool.release(conn)
            conn = None
        except ConnectionFailed as exc:
            answer.outcome = "connection_error"
            answer.error = str(exc)
        finally:
            if conn is not None:
                conn.close()

    async def _send(self, path: str, payload: bytes, answer: _Answer) -> Connection:
        """POST ``payload`` on a pooled connection, on a fresh one if a reused one turns
        out closed; ``ConnectionFailed`` when a fresh one fails."""
        while True:
            conn = await self.pool.acquire()
            try:
                await conn.send_request("POST", path, self.headers, payload)
                answer.sent = conn.sent_at - self.t0
                return conn
            except ConnectionFailed:
                conn.close()
                if not conn.reused:
                    raise

    async def _read_stream(self, conn: Connection, answer: _Answer) -> None:
        """Read a 200's event stream into ``answer``, each event stamped when its chunk
        arrived (Rule 4), and set its outcome."""
        parser = SSEParser()
        while True:
            data, ended = await conn.receive_body_chunk()
            if data:
                now = conn.received_at - conn.sent_at  # Rule 4
                for event in parser.feed(data):
                    answer.feed(event.data, now)
            if ended:
                break
        if answer.error is not None:
            answer.outcome = "stream_error"
        elif not answer.done:
            answer.outcome = "stream_error"
            answer.error = "stream ended without [DONE]"
        else:
            answer.outcome = "ok"

    def _body(self, endpoint: Endpoint, content: Any, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.cfg.model}
        body["messages" if endpoint == "chat" else "prompt"] = content
        body["max_tokens"] = max_tokens
        body["ignore_eos"] = True  # the trace's length, on inference-lab and on vLLM
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return body

    def _record(
        self, answer: _Answer, start: float, end: float, session: int, turn: int, line: int
    ) -> TurnRecord:
        record = TurnRecord(
            session=session,
            turn=turn,
            line=line,
            start=start,
            end=end,
            status=answer.status,
            outcome=answer.outcome,
            ttft=answer.ttft,
            prompt_tokens=answer.prompt_tokens,
            cached_tokens=answer.cached_tokens,
            completion_tokens=answer.completion_tokens,
            error=answer.error,
            sent=answer.sent,
        )
        self.records.append(record)
        return record

    # -- sessions ----------------------------------------------------------------------
    async def session(self, s: SessionRecord) -> None:
        """Rule 1: one conversation, turn after turn."""
        cfg = self.cfg
        path = endpoint_path(self.pool.origin.base_path, cfg.endpoint)
        messages: list[dict[str, str]] = []
        prompt = ""
        if s.system_prompt_tokens:
            tag = "[system prompt] " if s.shared_system_prompt else f"[system {s.session}] "
            system = prompt_text(tag, s.system_prompt_tokens)
            messages.append({"role": "system", "content": system})
            prompt = system
        for k, turn in enumerate(s.turns):
            if k:
                await trio.sleep(turn.think_time)
            user = prompt_text(f"[session {s.session} turn {k}] ", turn.user_tokens)
            if cfg.endpoint == "chat":
                messages.append({"role": "user", "content": user})
                content: Any = messages
            else:
                prompt += user
                content = prompt
            answer, start, end = await self.request(
                path, self._body(cfg.endpoint, content, turn.output_tokens)
            )
            self._record(answer, start, end, s.session, k, -1)
            if answer.outcome != "ok":
                return  # a failed turn ends its session
            text = "".join(answer.text)
            if cfg.endpoint == "chat":
                messages.append({"role": "assistant", "content": text})
            else:
                prompt += text

    async def sessions(self, sessions: tuple[SessionRecord, ...]) -> None:
        cfg = self.cfg
        async with trio.open_nursery() as nursery:
            if cfg.concurrency is not None:
                queue = iter(sessions)
                for _ in range(cfg.concurrency):
                    nursery.start_soon(self._user, queue)
            else:
                for s in sessions:
                    assert s.start is not None
                    nursery.start_soon(self._at, self.t0 + s.start, self.session, s)

    async def _user(self, queue: Iterator[SessionRecord]) -> None:
        for s in queue:  # Rule 2: the next session in file order
            await self.session(s)

    async def _at(self, when: float, fn: Callable[[Any], Any], arg: Any) -> None:
        await trio.sleep_until(when)
        await fn(arg)

    # -- traces ------------------------------------------------------------------------
    async def trace_request(self, r: TraceRequest) -> None:
        cfg = self.cfg
        if r.body is not None:  # openai_batch: the body as it is, streamed, to its url
            body = {**r.body, "model": cfg.model, "stream": True}
            body["stream_options"] = {"include_usage": True}
            endpoint: Endpoint = "chat" if r.url == "/v1/chat/completions" else "completions"
            path = endpoint_path(self.pool.origin.base_path, endpoint)
        else:
            text = trace_prompt(r)
            content: Any = [{"role": "user", "content": text}] if cfg.endpoint == "chat" else text
            body = self._body(cfg.endpoint, content, r.output_tokens)
            path = endpoint_path(self.pool.origin.base_path, cfg.endpoint)
        answer, start, end = await self.request(path, body)
        self._record(answer, start, end, -1, -1, r.line)

    async def trace(self, trace: Trace) -> None:
        async with trio.open_nursery() as nursery:
            for r in trace.requests:
                nursery.start_soon(self._at, self.t0 + r.time, self.trace_request, r)

    # -- the run -----------------------------------------------------------------------
    async def preflight(self) -> None:
        """One connection before the clock starts; with ``check_model``, the model list."""
        origin = self.pool.origin
        try:
            with trio.fail_after(self.cfg.connect_timeout):
                conn = await self.pool.acquire()
                if self.cfg.check_model:
                    headers = [("host", origin.authority), ("accept", "application/json")]
                    await conn.send_request("GET", models_path(origin.base_path), headers, b"")
                    response = await conn.receive_response()
                    body = await conn.read_body(_BODY_LIMIT)
                    served = parse_model_ids(body) if response.status_code == 200 else None
                    if served is None:
                        conn.close()
                        raise ReplayError(f"{origin} did not answer a model list")
                    if self.cfg.model not in served:
                        conn.close()
                        raise ReplayError(
                            f"model {self.cfg.model!r} is not served by {origin} "
                            f"(it serves: {', '.join(served[:20]) or 'none'})"
                        )
        except ConnectionFailed as exc:
            raise ReplayError(str(exc)) from None
        except trio.TooSlowError:
            raise ReplayError(f"cannot connect to {origin}: timed out") from None
        self.pool.release(conn)


def trace_prompt(r: TraceRequest) -> str:
    """A trace request's prompt (Rule 3): Mooncake's ``hash_ids`` as 512-token blocks of
    text named by their ids, the rest (and every other format's prompt) text of its own."""
    parts = [prompt_text(f"[block {h}] ", MOONCAKE_BLOCK) for h in r.hash_ids]
    text = "".join(parts)[: 4 * r.input_tokens]
    rest = r.input_tokens - len(text) // 4
    if rest > 0:
        text += prompt_text(f"[request {r.line}] ", rest)
    return text


def load_traffic(config: ReplayConfig) -> tuple[SessionRecord, ...] | Trace:
    """The session file or the trace (ConfigError, one line, naming file, line, field)."""
    if config.sessions is not None:
        sessions = read_sessions(config.sessions)
        if config.concurrency is None and any(s.start is None for s in sessions):
            raise ValueError(
                f"{config.sessions}: its sessions have no start times (a closed loop): "
                "give --concurrency N"
            )
        return sessions
    assert config.trace is not None
    start, end = config.window if config.window is not None else (0.0, None)
    return read_trace(
        config.trace,
        config.trace_format,
        speedup=config.speedup,
        start=start,
        end=end,
        tokenize=lambda url, body: (0,),  # sent as it is: the server counts its prompt
        default_max_tokens=config.default_max_tokens,
    )


async def run_replay(
    config: ReplayConfig,
    traffic: tuple[SessionRecord, ...] | Trace,
    *,
    stop: trio.Event | None = None,
    connect: Connect = connect_tcp,
) -> ReplayResult:
    """Replay ``traffic`` (from :func:`load_traffic`). Raises :class:`ReplayError` when the
    server cannot be reached or does not serve the model. ``stop`` ends the run at once
    (requests in flight are cancelled)."""
    replay = _Replay(config, connect)
    try:
        await replay.preflight()
        started_at = time.time()
        replay.t0 = trio.current_time()
        interrupted = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal interrupted
                assert stop is not None
                await stop.wait()
                interrupted = True
                nursery.cancel_scope.cancel()

            if stop is not None:
                nursery.start_soon(watch)
            if isinstance(traffic, Trace):
                await replay.trace(traffic)
            else:
                await replay.sessions(traffic)
            nursery.cancel_scope.cancel()
        return ReplayResult(
            config=config,
            started_at=started_at,
            end=trio.current_time() - replay.t0,
            records=tuple(sorted(replay.records, key=lambda r: r.start)),
            sessions=0 if isinstance(traffic, Trace) else len(traffic),
            interrupted=interrupted,
        )
    finally:
        replay.pool.close()


# -- the report ------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = q / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize_replay(result: ReplayResult) -> dict[str, Any]:
    """The replay's figures: outcomes, TTFT percentiles (ms) over all ok requests and per
    turn (sessions), and the prompt tokens the server reported cached."""
    records = result.records
    ok = [r for r in records if r.outcome == "ok"]

    def ttft_row(rs: list[TurnRecord]) -> dict[str, Any]:
        ttfts = [r.ttft * 1000 for r in rs if r.ttft is not None]
        prompt = sum(r.prompt_tokens or 0 for r in rs)
        cached = sum(r.cached_tokens or 0 for r in rs)
        return {
            "n": len(rs),
            "ttft_p50_ms": _percentile(ttfts, 50),
            "ttft_p90_ms": _percentile(ttfts, 90),
            "ttft_p99_ms": _percentile(ttfts, 99),
            "ttft_mean_ms": sum(ttfts) / len(ttfts) if ttfts else math.nan,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_share": cached / prompt if prompt else 0.0,
        }

    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    by_turn = []
    if result.sessions:
        for k in range(max((r.turn for r in ok), default=-1) + 1):
            by_turn.append({"turn": k, **ttft_row([r for r in ok if r.turn == k])})
    first_error = next((r.error for r in records if r.outcome != "ok" and r.error), None)
    return {
        "mode": "sessions" if result.sessions else "trace",
        "requests": len(records),
        "outcomes": outcomes,
        "duration_s": result.end,
        "all": ttft_row(ok),
        "by_turn": by_turn,
        "first_error": first_error,
    }


def format_replay(result: ReplayResult, summary: dict[str, Any]) -> str:
    cfg = result.config
    source = cfg.sessions if cfg.sessions is not None else cfg.trace
    what = f"{result.sessions} sessions" if result.sessions else "trace"
    lines = [
        f"load: replay of {what} from {source} | {cfg.endpoint}, stream",
        f"ran {result.end:.1f} s: {summary['requests']} requests; outcomes: "
        + " · ".join(f"{k} {v}" for k, v in sorted(summary["outcomes"].items())),
    ]
    head = f"{'turn':>6} {'n':>6} {'TTFT p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}  cached"
    lines.append(head + "   (ms; cached: share of prompt tokens)")
    rows = [(str(row["turn"]), row) for row in summary["by_turn"]] + [("all", summary["all"])]
    for name, row in rows:
        lines.append(
            f"{name:>6} {row['n']:>6} {row['ttft_p50_ms']:>9.2f} {row['ttft_p90_ms']:>9.2f} "
            f"{row['ttft_p99_ms']:>9.2f} {row['ttft_mean_ms']:>9.2f}  {row['cached_share']:6.1%}"
        )
    if summary["first_error"]:
        lines.append(f"first error: {summary['first_error']}")
    return "\n".join(lines)


def write_replay_csv(path: Path, result: ReplayResult) -> None:
    fields = [f.name for f in attrs.fields(TurnRecord)]
    with path.open("w", encoding="utf-8") as fh:
        fh.write(",".join(fields) + "\n")
        for r in result.records:
            row = []
            for name in fields:
                value = getattr(r, name)
                text = "" if value is None else str(value)
                row.append(json.dumps(text) if "," in text or '"' in text else text)
            fh.write(",".join(row) + "\n")
