"""The gate every request passes before any route answers it.

Rule 1: :func:`prepare` runs first for every request and decides the headers every answer
        to it carries (``Exchange.headers``); :func:`check` then decides, synchronously and
        before anything is read from the body, whether the request is refused outright.
Rule 2: the checks run in a fixed order (path, CORS preflight, control token, API key,
        content type) and the first refusal answers; every refusal is a whole :class:`Reply` from
        :mod:`inference_lab.serve.responses`.
"""

from __future__ import annotations

from inference_lab.serve.exchange import Exchange
from inference_lab.serve.responses import Reply
from inference_lab.serve.state import ServeState

__all__ = ["check", "prepare"]


def prepare(state: ServeState, exchange: Exchange) -> None:
    """Set the headers every answer to ``exchange`` carries."""


def _path(state: ServeState, exchange: Exchange) -> Reply | None:
    return None


def _preflight(state: ServeState, exchange: Exchange) -> Reply | None:
    return None


def _control_token(state: ServeState, exchange: Exchange) -> Reply | None:
    return None


def _api_key(state: ServeState, exchange: Exchange) -> Reply | None:
    return None


def _content_type(state: ServeState, exchange: Exchange) -> Reply | None:
    return None


_CHECKS = (_path, _preflight, _control_token, _api_key, _content_type)


def check(state: ServeState, exchange: Exchange) -> Reply | None:
    """The refusal of ``exchange``, or None to let its route answer it."""
    for rule in _CHECKS:
        reply = rule(state, exchange)
        if reply is not None:
            return reply
    return None
