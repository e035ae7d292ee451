"""Probes of the transport (``inference_lab/serve/transport``) for its tests: a hooked
connection over a socket pair, the events h11 records, h11's own parse of raw answers,
and the socket writes a served app makes."""

from __future__ import annotations

from typing import Any

import h11
import pytest
import trio

from inference_lab.serve import create_app, get_state
from inference_lab.serve.transport.connection import ReceiptStream, local_connection
from tests.conftest import make_settings
from tests.serve_util import serving

__all__ = ["answer_on_local_connection", "h11_answers", "record_h11_sends", "writes_of"]


async def answer_on_local_connection(app: Any, request: bytes) -> bytes:
    """Serve ``app`` on a hooked connection over a socket pair, send ``request``, read the
    answer up to the end of its head, close the client's end; returns once the
    connection's server is done."""
    server, client = local_connection(app)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            await client.send_all(request)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += await client.receive_some(4096)
            await client.aclose()
    return answer


def record_h11_sends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the names of the events every server-side h11 connection records as
    its own (its state machine's ``_process_event``: what ``send`` records), in order."""
    sent: list[str] = []
    plain_process = h11.Connection._process_event

    def recording_process(self: h11.Connection, role: Any, event: Any) -> None:
        if self.our_role is h11.SERVER and role is h11.SERVER:
            sent.append(type(event).__name__)
        plain_process(self, role, event)

    monkeypatch.setattr(h11.Connection, "_process_event", recording_process)
    return sent


def h11_answers(raw: bytes, requests: int) -> list[tuple[int, list[tuple[bytes, bytes]], bytes]]:
    """Parse ``raw`` as ``requests`` HTTP/1.1 answers with h11's own client (strict about
    the framing): (status, headers, body) each."""
    client = h11.Connection(h11.CLIENT)
    answers = []
    for i in range(requests):
        if i:
            client.start_next_cycle()
        client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        if i == 0:
            client.receive_data(raw)
        status, headers, body = 0, [], b""
        while True:
            event = client.next_event()
            if isinstance(event, h11.Response):
                status, headers = event.status_code, list(event.headers)
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise AssertionError(f"unexpected {event!r}")
        answers.append((status, headers, body))
    return answers


async def writes_of(
    requests: list[bytes],
    monkeypatch: pytest.MonkeyPatch,
    interval: float | None = None,
    slowdown: float = 1.0,
) -> list[list[bytes]]:
    """Serve the app as ``inference-lab serve`` does and send each of ``requests`` on its
    own connection; per request, the socket writes the server made. ``interval`` fixes
    the delivery's mid-stream interval (as a saturated loop sets it); ``slowdown`` prices
    the engine's steps at that many times the model's."""
    writes: list[tuple[Any, bytes]] = []
    plain_send_all = trio.SocketStream.send_all
    plain_send_nowait = ReceiptStream.send_nowait

    async def counting_send_all(self: trio.SocketStream, data: Any) -> None:
        writes.append((self, bytes(data)))
        await plain_send_all(self, data)

    def counting_send_nowait(self: ReceiptStream, data: bytes) -> int:
        sent = plain_send_nowait(self, data)
        if sent:
            writes.append((self, bytes(data[:sent])))
        return sent

    app = create_app(make_settings(max_num_seqs=1, max_waiting=1))
    state = get_state(app)
    per_request: list[list[bytes]] = []
    with trio.fail_after(20):
        async with serving(app) as port:
            if interval is not None:
                state.delivery.force_interval(interval)
            for runtime in state.runtimes.values():
                runtime.set_step_time_factor(slowdown)
            monkeypatch.setattr(trio.SocketStream, "send_all", counting_send_all)
            monkeypatch.setattr(ReceiptStream, "send_nowait", counting_send_nowait)
            for request in requests:
                writes.clear()
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(request)
                while await stream.receive_some(65536):
                    pass
                await stream.aclose()
                per_request.append([data for who, data in writes if who is not stream])
            monkeypatch.setattr(trio.SocketStream, "send_all", plain_send_all)
            monkeypatch.setattr(ReceiptStream, "send_nowait", plain_send_nowait)
            assert state.runtimes
    return per_request
