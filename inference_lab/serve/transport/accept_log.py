"""Running out of file descriptors, quietly.

When every descriptor is in use, trio's accept loop (``trio.serve_listeners``, which
hypercorn's trio worker runs) logs an error *with a traceback* each time it retries, ten
times a second, for as long as the shortage lasts; nothing else goes wrong: it accepts
again once descriptors are free.

Rule 1: such a record becomes one line without a traceback, at most one per
        :data:`EVERY` seconds (the others are dropped, and the next line says how many).
Rule 2: every other record of that logger passes untouched; installing twice installs
        once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["EVERY", "AcceptCapacityFilter", "install_accept_log_filter"]

#: Seconds between two lines about an accept loop out of descriptors.
EVERY = 1.0
_LOGGER = "trio.serve_listeners"


class AcceptCapacityFilter(logging.Filter):
    """Rate-limits and shortens trio's "accept returned EMFILE" records (module Rules)."""

    def __init__(self, every: float = EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every = every
        self._clock = clock
        self._last = -float("inf")
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("accept returned"):
            return True
        now = self._clock()
        if now - self._last < self.every:
            self._dropped += 1
            return False
        self._last = now
        dropped, self._dropped = self._dropped, 0
        code = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg = (
            "cannot accept connections: %s (out of file descriptors); accepting again "
            "as soon as some are free%s"
        )
        record.args = (code, f" ({dropped} repeats not logged)" if dropped else "")
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install_accept_log_filter() -> None:
    """Add the filter to trio's accept-loop logger, once per process."""
    logger = logging.getLogger(_LOGGER)
    if not any(isinstance(f, AcceptCapacityFilter) for f in logger.filters):
        logger.addFilter(AcceptCapacityFilter())
