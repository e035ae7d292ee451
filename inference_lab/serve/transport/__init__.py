"""The HTTP transport: hypercorn's HTTP/1.1 connection server, hooked, behind one interface.

Everything that touches hypercorn's or h11's internals lives in this package
(``connection.py``: the hooked connection server, with ``receipt.py``'s stream and
``idle_timer.py``'s keep-alive timer; ``launch.py``: hypercorn's trio worker
on a socket the server bound; ``accept_log.py``: trio's accept loop out of descriptors;
``quick.py``: requests the connection answers itself). The rest of the server imports only the names below, from
here. The functions taking ``send`` take the ASGI ``send`` callable the server handed a
request:

- :func:`received_at` -- the arrival stamp: when the server received the request.
- :func:`close_watch` -- the connection's close watch: ``watch_close(callback)`` has
  ``callback`` called synchronously once the client has gone; ``unwatch_close()``.
- :func:`one_write` -- an async context whose writes leave in one socket write.
- :func:`chunk_writer` -- a :class:`ChunkWriter` for a started, chunked response's
  mid-body chunks, written pre-framed straight to the connection (also synchronously,
  ``write_nowait``, from code that cannot await).
- :func:`connection_socket` -- the connection's trio socket stream.
- :func:`install_connection_hook` -- have hypercorn's trio worker serve every connection
  with the hooked connection server (``create_app`` calls it).
- :func:`serve` -- serve an app on a socket the server bound (``inference-lab serve``).
- :func:`enable_receive_timestamps` -- have the kernel stamp what a socket receives.
- :func:`local_connection` -- a hooked connection over a local socket pair (the start-up
  warm-up, tests and benchmarks).
- :class:`QuickReply` -- what an app's ``quick_answer`` returns for a request the
  connection answers itself, before the queue of work (``quick.py``: ``GET /health``).
- :class:`SideChannel` -- the server's own JSON POSTs to a peer server
  (``side_channel.py``: a decode server's claims on a prefill server's KV), with
  :class:`PeerAnswer` and :class:`PeerUnavailable`.

Rule 1: no module of the server outside this package imports hypercorn or h11, nor this
        package's modules (``tests/test_layers.py`` walks the imports).
Rule 2: every function taking ``send`` has a plain fallback where ``send`` is not a hooked
        connection's (another ASGI server, the in-memory test client): hypercorn's parse
        time or the time of the call for the stamp, None for the close watch, the chunk
        writer and the socket (the caller then uses the ASGI messages), a pass-through
        for the single write. The app is correct either way; the hooks make it faithful
        (the stamp, the close watch) or cheaper (the rest: ``docs/internals.md``, "The
        transport").
"""

from __future__ import annotations

from inference_lab.serve.transport.connection import (
    ChunkWriter,
    CloseWatch,
    OneWrite,
    chunk_writer,
    close_watch,
    connection_socket,
    enable_receive_timestamps,
    install_connection_hook,
    local_connection,
    one_write,
    received_at,
)
from inference_lab.serve.transport.launch import serve
from inference_lab.serve.transport.quick import QuickReply
from inference_lab.serve.transport.side_channel import PeerAnswer, PeerUnavailable, SideChannel

__all__ = [
    "ChunkWriter",
    "CloseWatch",
    "OneWrite",
    "PeerAnswer",
    "PeerUnavailable",
    "QuickReply",
    "SideChannel",
    "chunk_writer",
    "close_watch",
    "connection_socket",
    "enable_receive_timestamps",
    "install_connection_hook",
    "local_connection",
    "one_write",
    "received_at",
    "serve",
]
