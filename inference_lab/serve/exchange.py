"""One HTTP exchange as the app's ASGI connection sees it.

Rule 1: an :class:`Exchange` is made once per request, first thing, by the app's ASGI
        connection (or, for a request the connection answers where it reads it, by that
        answer: :meth:`Exchange.read_whole`), and handed to everything that answers the
        request; it is the one place that knows the request's arrival time and the
        headers every answer to it must carry (request id, CORS), whichever code path
        answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs

__all__ = ["PACING_LAG_HEADER", "Exchange", "Receive", "Send"]

#: The response header that tells a client how late the model's engine was when its
#: request reached admission (Rule 2): a client-measured TTFT above the model's has a
#: visible reason when the host, not the model, was the bottleneck.
PACING_LAG_HEADER = b"inference-lab-pacing-lag-ms"
_NO_LAG = (PACING_LAG_HEADER, b"0.00")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@attrs.define(eq=False)
class Exchange:
    """A request's scope, its arrival (trio time) and what its answers must carry."""

    scope: dict[str, Any]
    arrival: float
    #: Headers added to every response start of this exchange.
    headers: list[tuple[bytes, bytes]] = attrs.field(factory=list)
    #: The id the server gave this request (set by the gate's ``prepare``): a completion's
    #: body ``id``, and ``x-request-id`` unless the client sent a usable one.
    request_id: str = ""
    #: The pacing-lag header is among :attr:`headers` (Rule 2).
    lag_noted: bool = False

    @classmethod
    def read_whole(
        cls,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        client: tuple[str, int] | None,
        arrival: float,
    ) -> Exchange:
        """The exchange of a request the connection answers where it reads it
        (``transport.quick``): the scope an ASGI connection would give it, without a
        query string."""
        scope: dict[str, Any] = {
            "type": "http",
            "method": method,
            "path": path,
            "query_string": b"",
            "headers": headers,
            "client": client,
        }
        return cls(scope, arrival)

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    @property
    def path(self) -> str:
        return str(self.scope["path"])

    def header(self, name: bytes) -> bytes | None:
        """The first request header called ``name`` (lower case), or None."""
        for key, value in self.scope["headers"]:
            if key == name:
                return bytes(value)
        return None

    def note_pacing_lag(self, lag: float) -> None:
        """Add the pacing-lag header (``lag`` seconds, from ``ModelRuntime.pacing_lag``)
        to every answer of this exchange from now on, once (Rule 2); called where a
        generation route reaches a model's admission."""
        if self.lag_noted:
            return
        self.lag_noted = True
        self.headers.append(_NO_LAG if lag <= 0.0 else (PACING_LAG_HEADER, b"%.2f" % (lag * 1e3)))

    def wrap(self, send: Send) -> Send:
        """``send`` with this exchange's headers added to the response start (``send``
        itself when there are none)."""
        if not self.headers:
            return send
        extra = self.headers

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return send_with_headers
