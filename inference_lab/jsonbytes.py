"""Compact JSON bytes: the one encoder of every JSON body and SSE frame the server sends.

Rule 1: compact (``separators=(",", ":")``), non-ASCII characters written as UTF-8, key
        order as given.
Rule 2: encoding never fails on a string that came from a client: a lone surrogate (which
        UTF-8 cannot hold) is written as its JSON escape ``\\ud800``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["dumps", "dumps_str"]

_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps_str(value: Any) -> str:
    """``value`` as compact JSON text (may hold lone surrogates; see :func:`dumps`)."""
    return _ENCODER.encode(value)


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON in UTF-8. A lone surrogate inside a string becomes the
    escape ``\\udXXX`` (valid JSON), so this never raises UnicodeEncodeError."""
    text = _ENCODER.encode(value)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # Surrogates only occur inside JSON strings, where "\\udXXX" is the JSON escape.
        return text.encode("utf-8", "backslashreplace")
