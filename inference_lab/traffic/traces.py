"""Trace files: timed requests in the formats people have.

| format | file | a row |
|---|---|---|
| ``mooncake`` | JSONL | ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one per 512-token block, each standing for the prefix up to its block's end) |
| ``azure`` | CSV | ``TIMESTAMP`` (a date and time), ``ContextTokens``, ``GeneratedTokens`` (Azure LLM inference traces, 2023 and 2024) |
| ``burstgpt`` | CSV | ``Timestamp`` (s), ``Model``, ``Request tokens``, ``Response tokens``, ``Total tokens``, ``Log Type`` |
| ``openai_batch`` | JSONL | ``custom_id``, ``method``, ``url`` (``/v1/chat/completions`` or ``/v1/completions``), ``body`` (the request; no time: every request at 0) |

Rule 1: a bad row is a :class:`~inference_lab.errors.ConfigError` of one line naming the
        file, the line and the field (``trace.jsonl:7: input_length: must be an integer
        >= 1, got -3``); nothing is returned from a file with a bad row.
Rule 2: a row the trace itself marks as failed (0 prompt or 0 output tokens in the
        Azure and BurstGPT CSVs) is skipped and counted, not an error.
Rule 3: times are seconds from the trace's first request (the earliest time in the
        file). The window keeps the requests with ``start <= t < end``; the kept times are
        then shifted so that ``start`` is 0 and divided by ``speedup``. Requests come out
        in time order (file order among equal times).
Rule 4: every number is bounded where a consumer would otherwise run out of memory or
        time, the bound named in the error: token counts at most :data:`MAX_TOKENS`,
        ``n`` at most :data:`MAX_N`, ``hash_ids`` signed 64-bit integers, a request at
        most :data:`MAX_SPAN` seconds after the trace's first (and after the window and
        the speedup), JSON nested no deeper than the decoder allows.
Rule 5: pure: no clock, no engine. An ``openai_batch`` body is tokenized by the caller's
        function (the simulator passes the byte rule or ``--tokenizer``; a client replaying
        the file sends the body as it is).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from inference_lab.errors import ConfigError

__all__ = [
    "FORMATS",
    "MAX_N",
    "MAX_SPAN",
    "MAX_TOKENS",
    "MOONCAKE_BLOCK",
    "Trace",
    "TraceRequest",
    "Tokenize",
    "detect_format",
    "read_trace",
]

FORMATS = ("mooncake", "azure", "burstgpt", "openai_batch")
#: Tokens per ``hash_ids`` entry in Mooncake's traces.
MOONCAKE_BLOCK = 512
#: The endpoints an ``openai_batch`` line may name.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
#: Most prompt or output tokens of one request (Rule 4): past any model's context, and
#: a prompt a load client can still write (about 40 MB of text).
MAX_TOKENS = 10_000_000
#: Most sequences of one ``openai_batch`` request (OpenAI's bound on ``n``).
MAX_N = 128
#: Latest a request may come after the trace's first, in seconds, read and replayed
#: (Rule 4): 366 days. A later one is a typo or a unit error, and a replay would wait
#: for it.
MAX_SPAN = 366 * 86_400.0
#: What each format calls its time column, for errors.
TIME_KEYS = {"mooncake": "timestamp", "azure": "TIMESTAMP", "burstgpt": "Timestamp"}
#: ``hash_ids`` entries are signed 64-bit integers (what a block label packs).
_HASH_ID_RANGE = (-(2**63), 2**63 - 1)

#: Tokenizes an ``openai_batch`` body: (url, body) -> prompt token ids. Raises ValueError
#: with a message naming what is wrong with the body.
Tokenize = Callable[[str, Mapping[str, Any]], Sequence[int]]


@attrs.frozen(kw_only=True)
class TraceRequest:
    """One request of a trace: when (seconds, after the window and the speedup), how many
    prompt and output tokens, and what the trace says about its content (``hash_ids`` of
    ``trace_block``-token blocks; an ``openai_batch`` line's prompt token ids, body and
    ``n``). ``line`` is its line in the file."""

    time: float
    input_tokens: int
    output_tokens: int
    line: int
    hash_ids: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    n: int = 1
    url: str | None = None
    body: Mapping[str, Any] | None = None


@attrs.frozen(kw_only=True)
class Trace:
    """A trace file read and windowed: its requests, how many rows it had and how many
    were skipped as failed (Rule 2) or fell outside the window."""

    path: Path
    format: str
    requests: tuple[TraceRequest, ...]
    rows: int
    skipped_failed: int
    outside_window: int
    speedup: float
    start: float
    end: float | None

    @property
    def has_content(self) -> bool:
        """Whether the trace says anything about its requests' tokens (prefix caching can
        only hit on such a trace)."""
        return any(r.hash_ids or r.tokens for r in self.requests)


class _RowError(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _int(row: Mapping[str, Any], key: str, minimum: int, maximum: int = MAX_TOKENS) -> int:
    """An integer field in ``minimum..maximum``: a JSON integer, or a CSV cell holding one
    (CSV cells are text)."""
    if key not in row:
        raise _RowError(key, "missing")
    value = row[key]
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise _RowError(key, f"must be an integer >= {minimum}, got {row[key]!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _RowError(key, f"must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise _RowError(key, f"must be at most {maximum:,}, got {value!r}")
    return value


def _number(row: Mapping[str, Any], key: str) -> float:
    """A number >= 0: a JSON number, or a CSV cell holding one."""
    if key not in row:
        raise _RowError(key, "missing")
    value = row[key]
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise _RowError(key, f"must be a number >= 0, got {row[key]!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _RowError(key, f"must be a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise _RowError(key, f"must be a number >= 0, got {value!r}")
    return float(value)


def _json_int(row: Mapping[str, Any], key: str, minimum: int, maximum: int = MAX_TOKENS) -> int:
    """An integer field of a JSON row: a string holding digits is not an integer."""
    if isinstance(row.get(key), str):
        raise _RowError(key, f"must be an integer >= {minimum}, got {row[key]!r}")
    return _int(row, key, minimum, maximum)


def _json_number(row: Mapping[str, Any], key: str) -> float:
    if isinstance(row.get(key), str):
        raise _RowError(key, f"must be a number >= 0, got {row[key]!r}")
    return _number(row, key)


def _azure_time(row: Mapping[str, Any], key: str) -> float:
    """Seconds since the epoch of an Azure trace's ``TIMESTAMP`` (``2023-11-16
    18:15:46.6805900``, up to 7 fractional digits, an optional UTC offset)."""
    text = row.get(key)
    if text is None:
        raise _RowError(key, "missing")
    raw = text.strip()
    offset = ""
    for sign in ("+", "-"):
        cut = raw.rfind(sign)
        if cut > 10:  # past the date's own dashes
            raw, offset = raw[:cut], raw[cut:]
            break
    if "." in raw:
        whole, frac = raw.split(".", 1)
        raw = f"{whole}.{(frac + '000000')[:6]}"
    try:
        when = datetime.datetime.fromisoformat(raw + offset)
    except ValueError:
        raise _RowError(key, f"must be a date and time, got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                yield number, line


def _json_rows(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    for number, line in _lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: invalid JSON: {exc.msg}") from None
        except RecursionError:
            raise ConfigError(f"{path}:{number}: invalid JSON: nested too deep") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{number}: must be a JSON object, got {line.strip()[:40]!r}")
        yield number, row


def _csv_rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, Mapping[str, Any]]]:
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        header = [name.strip() for name in reader.fieldnames or ()]
        missing = [name for name in required if name not in header]
        if missing:
            raise ConfigError(
                f"{path}:1: header: missing column(s) {', '.join(missing)} "
                f"(has {', '.join(header) or 'none'})"
            )
        reader.fieldnames = header
        for row in reader:
            if None in row:
                raise ConfigError(f"{path}:{reader.line_num}: more fields than the header")
            yield reader.line_num, row


# one parser per format: rows -> (raw time in seconds, request without time) or None (skipped)

Parsed = tuple[float, TraceRequest] | None


def _mooncake(number: int, row: Mapping[str, Any], _tokenize: Tokenize | None) -> Parsed:
    t = _json_number(row, "timestamp") / 1000.0
    hash_ids = row.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise _RowError("hash_ids", f"must be a list of integers, got {hash_ids!r}")
    lo, hi = _HASH_ID_RANGE
    wide = next((h for h in hash_ids if not lo <= h <= hi), None)
    if wide is not None:
        raise _RowError("hash_ids", f"must be 64-bit integers (-2**63..2**63-1), got {wide}")
    return t, TraceRequest(
        time=0.0,
        input_tokens=_json_int(row, "input_length", 1),
        output_tokens=_json_int(row, "output_length", 1),
        hash_ids=tuple(hash_ids),
        line=number,
    )


def _azure(number: int, row: Mapping[str, Any], _tokenize: Tokenize | None) -> Parsed:
    t = _azure_time(row, "TIMESTAMP")
    context = _int(row, "ContextTokens", 0)
    generated = _int(row, "GeneratedTokens", 0)
    if context == 0 or generated == 0:
        return None
    return t, TraceRequest(time=0.0, input_tokens=context, output_tokens=generated, line=number)


def _burstgpt(number: int, row: Mapping[str, Any], _tokenize: Tokenize | None) -> Parsed:
    t = _number(row, "Timestamp")
    request = _int(row, "Request tokens", 0)
    response = _int(row, "Response tokens", 0)
    if request == 0 or response == 0:
        return None
    return t, TraceRequest(time=0.0, input_tokens=request, output_tokens=response, line=number)


def _batch(
    number: int, row: Mapping[str, Any], tokenize: Tokenize | None, default_max_tokens: int | None
) -> Parsed:
    url = row.get("url")
    if url not in BATCH_URLS:
        raise _RowError("url", f"must be one of {', '.join(BATCH_URLS)}; got {url!r}")
    body = row.get("body")
    if not isinstance(body, dict):
        raise _RowError("body", f"must be an object, got {body!r}")
    output: int | None = None
    try:
        for key in ("max_completion_tokens", "max_tokens"):
            if body.get(key) is not None:
                output = _json_int(body, key, 1)
                break
        n = _json_int(body, "n", 1, MAX_N) if body.get("n") is not None else 1
    except _RowError as exc:
        raise _RowError(f"body.{exc.field}", str(exc)) from None
    if output is None:
        if default_max_tokens is None:
            raise _RowError(
                "body.max_tokens", "missing (give max_tokens in the body, or a default)"
            )
        output = default_max_tokens
    if tokenize is None:
        raise _RowError("body", "openai_batch needs a tokenizer to count its prompts")
    try:
        tokens = tuple(tokenize(url, body))
    except ValueError as exc:
        raise _RowError("body", str(exc)) from None
    if not tokens:
        raise _RowError("body", "the prompt has no tokens")
    return 0.0, TraceRequest(
        time=0.0,
        input_tokens=len(tokens),
        output_tokens=output,
        tokens=tokens,
        n=n,
        url=url,
        body=body,
        line=number,
    )


def _window(
    parsed: list[tuple[float, TraceRequest]],
    file: Path,
    fmt: str,
    speedup: float,
    start: float,
    end: float | None,
) -> tuple[list[TraceRequest], int]:
    """The requests of the window, timed from its start and sped up, in time order (Rule
    3), and how many fell outside; ConfigError past :data:`MAX_SPAN` (Rule 4)."""
    origin = min((t for t, _ in parsed), default=0.0)
    kept = []
    outside = 0
    for t, request in parsed:
        rel = t - origin
        if rel > MAX_SPAN:
            raise ConfigError(
                f"{file}:{request.line}: {TIME_KEYS.get(fmt, 'time')}: {rel:g} s after the "
                f"trace's first request; a trace may span at most {MAX_SPAN:,.0f} s (366 days)"
            )
        if rel < start or (end is not None and rel >= end):
            outside += 1
            continue
        at = (rel - start) / speedup
        if at > MAX_SPAN:
            raise ConfigError(
                f"{file}:{request.line}: at speedup {speedup:g} this request comes {at:g} s "
                f"into the replay, past the {MAX_SPAN:,.0f} s (366 days) a replay may last"
            )
        kept.append(attrs.evolve(request, time=at))
    kept.sort(key=lambda r: r.time)  # stable: file order among equal times
    return kept, outside


def detect_format(path: Path) -> str:
    """The format of ``path`` from its first line: a JSON object with ``body`` is
    ``openai_batch``, any other ``mooncake``; a CSV header with ``ContextTokens`` is
    ``azure``, with ``Request tokens`` ``burstgpt``. ConfigError if none fits."""
    try:
        first = next(_lines(path), (0, ""))[1].strip()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    if first.startswith("{"):
        try:
            row = json.loads(first)
        except (json.JSONDecodeError, RecursionError):
            row = {}
        return "openai_batch" if isinstance(row, dict) and "body" in row else "mooncake"
    if "ContextTokens" in first:
        return "azure"
    if "Request tokens" in first:
        return "burstgpt"
    raise ConfigError(
        f"{path}: cannot tell the trace format from its first line; name it "
        f"(one of {', '.join(FORMATS)})"
    )


def read_trace(
    path: str | Path,
    format: str | None = None,
    *,
    speedup: float = 1.0,
    start: float = 0.0,
    end: float | None = None,
    tokenize: Tokenize | None = None,
    default_max_tokens: int | None = None,
) -> Trace:
    """Read a trace file (``format`` None: :func:`detect_format`), keep the window
    ``[start, end)`` of trace seconds and scale its times by ``1 / speedup`` (Rule 3).
    ``tokenize`` and ``default_max_tokens`` serve ``openai_batch`` only. Raises
    ConfigError (Rule 1)."""
    file = Path(path)
    fmt = detect_format(file) if format is None else format
    if fmt not in FORMATS:
        raise ConfigError(f"{file}: trace format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if not speedup > 0 or not math.isfinite(speedup):
        raise ConfigError(f"{file}: speedup must be a number > 0, got {speedup!r}")
    if start < 0 or (end is not None and not end > start):
        raise ConfigError(f"{file}: the window must have 0 <= start < end, got {start}..{end}")
    parsed, count, skipped = _parse_rows(file, fmt, tokenize, default_max_tokens)
    kept, outside = _window(parsed, file, fmt, speedup, start, end)
    return Trace(
        path=file,
        format=fmt,
        requests=tuple(kept),
        rows=count,
        skipped_failed=skipped,
        outside_window=outside,
        speedup=speedup,
        start=start,
        end=end,
    )


def _parse_rows(
    file: Path, fmt: str, tokenize: Tokenize | None, default_max_tokens: int | None
) -> tuple[list[tuple[float, TraceRequest]], int, int]:
    """``read_trace``'s rows of ``file`` in format ``fmt``: the requests parsed (trace
    time, request), the rows read and the rows skipped as failed requests. A bad row or
    an unreadable file is one ConfigError line (Rule 1)."""
    rows: Iterator[tuple[int, Mapping[str, Any]]]
    if fmt == "azure":
        rows = _csv_rows(file, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    elif fmt == "burstgpt":
        rows = _csv_rows(file, ("Timestamp", "Request tokens", "Response tokens"))
    else:
        rows = _json_rows(file)
    parsed: list[tuple[float, TraceRequest]] = []
    count = skipped = 0
    try:
        for number, row in rows:
            count += 1
            try:
                item = _parse_row(fmt, number, row, tokenize, default_max_tokens)
            except _RowError as exc:
                raise ConfigError(f"{file}:{number}: {exc.field}: {exc}") from None
            if item is None:
                skipped += 1
            else:
                parsed.append(item)
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not UTF-8 text") from None
    except csv.Error as exc:
        raise ConfigError(f"{file}: invalid CSV: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None
    return parsed, count, skipped


def _parse_row(
    fmt: str,
    number: int,
    row: Mapping[str, Any],
    tokenize: Tokenize | None,
    default_max_tokens: int | None,
) -> Parsed:
    """One row in format ``fmt`` (``_RowError`` naming the field for a bad one)."""
    if fmt == "mooncake":
        return _mooncake(number, row, tokenize)
    if fmt == "azure":
        return _azure(number, row, tokenize)
    if fmt == "burstgpt":
        return _burstgpt(number, row, tokenize)
    return _batch(number, row, tokenize, default_max_tokens)
