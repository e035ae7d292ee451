"""The proxy's backends: the prefill and decode pools, how a request picks from them, and
one exchange with a backend over the load client's HTTP/1.1 stack (``client/http.py``).

Rule 1: a pool orders its backends for each request: ``round_robin`` starts one further
        each time, ``least_outstanding`` at the one with the fewest requests in flight
        (the lowest index on a tie); the rest follow in index order, so a request tries
        the next one when its first choice cannot be reached.
Rule 2: a backend counts the requests in flight to it (``outstanding``) from the moment it
        is chosen until its answer has been read to its end or abandoned; every exchange
        (:class:`Exchange`) gives its connection back to the pool only when its answer was
        read whole, and closes it otherwise (``client/http.py`` Rule 2).
Rule 3: every wait on a backend is bounded: its answer's head within ``timeout`` seconds of
        the request, and each later piece of its body within ``timeout`` of the previous
        one; a backend that cannot be reached, breaks the protocol or stays silent is a
        :class:`BackendFailed` naming it.
Rule 4: backend connections are opened without the kernel's receive timestamps
        (``client/http.py``'s ``connect_tcp_unstamped``): the proxy measures nothing by
        them, and a relayed stream reads once per token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import Literal

import attrs
import trio

from inference_lab.client.http import (
    Connect,
    Connection,
    ConnectionFailed,
    ConnectionPool,
    Origin,
    connect_tcp_unstamped,
)

__all__ = ["POLICIES", "Backend", "BackendFailed", "Exchange", "Pool"]

#: How a pool picks the backend a request tries first (Rule 1).
POLICIES = ("round_robin", "least_outstanding")
Policy = Literal["round_robin", "least_outstanding"]
#: The headers of a backend's answer that reach the client.
PASSED_HEADERS = frozenset(
    {b"content-type", b"cache-control", b"retry-after", b"x-should-retry", b"x-request-id"}
)


class BackendFailed(Exception):
    """A backend could not be reached, broke the protocol or stayed silent (Rule 3);
    ``str()`` names it and says why."""


@attrs.define(eq=False)
class Backend:
    """One server of a pool and its counts."""

    url: str
    origin: Origin
    pool: ConnectionPool
    index: int
    outstanding: int = 0
    requests: int = 0
    failures: int = 0

    def statistics(self) -> dict[str, object]:
        return {
            "url": self.url,
            "requests": self.requests,
            "failures": self.failures,
            "outstanding": self.outstanding,
        }


class Pool:
    """A pool of backends of one role (``prefill`` or ``decode``) and its policy."""

    def __init__(
        self,
        role: str,
        origins: Sequence[Origin],
        policy: Policy,
        *,
        connect: Connect = connect_tcp_unstamped,
    ) -> None:
        self.role = role
        self.policy = policy
        self.backends = [
            Backend(str(origin), origin, ConnectionPool(origin, connect=connect), i)
            for i, origin in enumerate(origins)
        ]
        self._next = itertools.cycle(range(len(self.backends)))

    def order(self) -> list[Backend]:
        """The backends in the order one request tries them (Rule 1)."""
        backends = self.backends
        if self.policy == "round_robin":
            first = next(self._next)
        else:
            first = min(backends, key=lambda b: (b.outstanding, b.index)).index
        return [backends[first], *(b for b in backends if b.index != first)]

    def close(self) -> None:
        for backend in self.backends:
            backend.pool.close()


class Exchange:
    """One request to ``backend`` and its answer (Rules 2-3), as an async context:

    async with Exchange(backend, timeout, "POST", path, headers, body) as answer:
        ... answer.status, answer.headers, await answer.chunk() ...
    """

    def __init__(
        self,
        backend: Backend,
        timeout: float,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes = b"",
    ) -> None:
        self.backend = backend
        self.timeout = timeout
        self._request = (method, backend.origin.base_path + target, headers, body)
        self._conn: Connection | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.ended = False
        self._open = False

    def _failed(self, why: str) -> BackendFailed:
        self.backend.failures += 1
        return BackendFailed(f"the {self.backend.url} backend: {why}")

    async def __aenter__(self) -> Exchange:
        backend = self.backend
        backend.outstanding += 1
        backend.requests += 1
        self._open = True
        method, target, headers, body = self._request
        try:
            with trio.fail_after(self.timeout):
                self._conn = await backend.pool.acquire()
                await self._conn.send_request(
                    method, target, [("host", backend.origin.authority), *headers], body
                )
                head = await self._conn.receive_response()
        except ConnectionFailed as exc:
            self._finish()
            raise self._failed(str(exc)) from None
        except trio.TooSlowError:
            self._finish()
            raise self._failed(f"no answer within {self.timeout:g} s") from None
        except BaseException:
            self._finish()
            raise
        self.status = head.status_code
        self.headers = [(bytes(k), bytes(v)) for k, v in head.headers if k in PASSED_HEADERS]
        return self

    async def chunk(self) -> bytes:
        """The next piece of the answer's body (``ended`` once it is whole); raises
        :class:`BackendFailed` (Rule 3)."""
        assert self._conn is not None
        data = b""
        # (a bare cancel scope: ``fail_after``'s generator-based context manager costs more,
        # and a relayed stream takes this path once per piece)
        with trio.CancelScope(deadline=trio.current_time() + self.timeout) as scope:
            try:
                data, self.ended = await self._conn.receive_body_chunk()
            except ConnectionFailed as exc:
                raise self._failed(str(exc)) from None
        if scope.cancelled_caught:
            raise self._failed(f"silent for {self.timeout:g} s mid-answer")
        return data

    async def body(self, limit: int) -> bytes:
        """The rest of the body, at most ``limit`` bytes (else :class:`BackendFailed`)."""
        parts: list[bytes] = []
        size = 0
        while not self.ended:
            data = await self.chunk()
            size += len(data)
            if size > limit:
                raise self._failed(f"an answer longer than {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()

    def _finish(self) -> None:
        """Give the connection back (a whole answer) or close it; count the backend's
        request as no longer in flight. Synchronous, once (Rule 2)."""
        if not self._open:
            return
        self._open = False
        self.backend.outstanding -= 1
        conn, self._conn = self._conn, None
        if conn is not None:
            if self.ended:
                self.backend.pool.release(conn)  # (kept only if the exchange was clean)
            else:
                conn.close()
