"""The load client's connections note when a request left and when bytes arrived
(``client/http.py`` Rule 5): on a real socket a read is stamped by the kernel's receive
timestamp, not when the client got round to reading.
"""

from __future__ import annotations

import pytest
import trio

from inference_lab.client.http import Connection, Origin, TCPTransport, connect_tcp
from inference_lab.socket_stamps import SO_TIMESTAMPNS

#: Seconds the client waits before reading what the server sent, and the margin of a
#: stamp's conversion from the wall clock on a busy machine.
LATER = 0.2
MARGIN = 0.1


@pytest.mark.skipif(SO_TIMESTAMPNS is None, reason="no kernel receive timestamps here")
async def test_a_read_is_stamped_when_its_bytes_arrived_not_when_it_was_read() -> None:
    """The server's answer arrives, the client reads it :data:`LATER` seconds after: the
    connection's ``received_at`` is the arrival. The kernel turns its stamping on for the
    whole system a moment after the first socket asks (until then a read is stamped when
    it returns), so the check is repeated on fresh connections until it holds."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    host, port = listener.getsockname()
    with trio.fail_after(20):
        while True:
            transport = await connect_tcp(Origin(host=host, port=port))
            assert isinstance(transport, TCPTransport)
            conn = Connection(transport)
            accepted, _ = await listener.accept()
            await conn.send_request("POST", "/", [("host", "x")], b"{}")
            sent_at = conn.sent_at
            assert await accepted.recv(100)
            answered = trio.current_time()
            await accepted.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await trio.sleep(LATER)
            assert (await conn.receive_response()).status_code == 200
            got_at = conn.received_at
            accepted.close()
            transport.close()
            assert sent_at <= answered
            if got_at <= answered + MARGIN:
                assert answered - 0.005 <= got_at
                return
    listener.close()
