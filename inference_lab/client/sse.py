"""A sans-IO parser for ``text/event-stream`` (server-sent events).

Feed it bytes in whatever pieces the network delivers; it returns the events completed so
far. It does no I/O and keeps no clock, so the same object works under trio, in a test, or
in a benchmark.

Rule 1: the events returned do not depend on how the input was split. Line endings may be
  ``\\n``, ``\\r\\n`` or ``\\r``; a ``\\r\\n`` split between two ``feed`` calls is one line
  ending, not two (``_pending_cr`` remembers a trailing ``\\r``).
Rule 2: bytes are decoded only once a whole event is complete, so a multi-byte UTF-8
  character split between two ``feed`` calls is never torn. Line parsing on bytes is safe
  because ``\\r``, ``\\n`` and ``:`` are ASCII and never occur inside a UTF-8 sequence.
Rule 3: the internal buffer only ever holds the current, unterminated line; it never
  contains ``\\r`` or ``\\n``.

Field handling follows the WHATWG HTML "event stream interpretation": ``data`` lines are
joined with ``\\n``; lines starting with ``:`` are comments; ``event`` and ``id`` are
tracked; other fields (``retry`` too: the load client never reconnects) are ignored; an
event is dispatched at a blank line only if it had at least one ``data`` line; an
unterminated event at end of stream is discarded.
"""

from __future__ import annotations

import attrs

__all__ = ["SSEParser", "ServerSentEvent"]

_BOM = b"\xef\xbb\xbf"


@attrs.frozen
class ServerSentEvent:
    """One dispatched event. ``data`` is the decoded payload (``[DONE]`` included)."""

    data: str
    event: str = "message"
    id: str = ""


class SSEParser:
    """Incremental event-stream parser; one instance per HTTP response body.

    Called by the load generator once per received chunk. ``feed`` is cheap in the common
    case of ``data: ...\\n\\n`` frames: one ``split``, then a ``startswith`` per line.
    """

    __slots__ = ("_buffer", "_data", "_event", "_last_id", "_pending_cr", "_started")

    def __init__(self) -> None:
        self._buffer = b""
        self._pending_cr = False
        self._started = False
        self._data: list[bytes] = []
        self._event = b""
        self._last_id = b""

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Consume ``chunk`` and return the events it completed, in order."""
        lines = self._complete_lines(chunk)
        if lines is None:
            return []
        events: list[ServerSentEvent] = []
        data = self._data
        for line in lines:
            if not line:
                if data:
                    events.append(self._dispatch())
                    data = self._data
                else:
                    self._event = b""
            elif line.startswith(b"data:"):
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line[0] != 0x3A:  # not a ":" comment
                self._field(line)
        return events

    def _complete_lines(self, chunk: bytes) -> list[bytes] | None:
        """The lines ``chunk`` completes, line endings normalised to ``\\n`` and a leading
        BOM dropped; the incomplete tail stays buffered. None when it completes none."""
        if not chunk:
            return None
        if self._pending_cr:
            # The previous chunk ended with "\r": a leading "\n" here completes that "\r\n".
            self._pending_cr = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
                if not chunk:
                    return None
        if b"\r" in chunk:
            self._pending_cr = chunk[-1] == 0x0D
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:
            self._buffer += chunk
            return None
        if self._buffer:
            chunk = self._buffer + chunk
        lines = chunk.split(b"\n")
        self._buffer = lines.pop()
        if not self._started:
            self._started = True
            if lines[0].startswith(_BOM):
                lines[0] = lines[0][3:]
        return lines

    def _field(self, line: bytes) -> None:
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value
        elif name == b"id":
            if b"\0" not in value:
                self._last_id = value

    def _dispatch(self) -> ServerSentEvent:
        data = self._data
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        self._data = []
        event = self._event
        self._event = b""
        return ServerSentEvent(
            payload.decode("utf-8", "replace"),
            event.decode("utf-8", "replace") if event else "message",
            self._last_id.decode("utf-8", "replace") if self._last_id else "",
        )
