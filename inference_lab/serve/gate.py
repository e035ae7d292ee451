"""The gate every request passes before any route answers it.

Rule 1: :func:`prepare` runs first for every request and decides the headers every answer
        to it carries (``Exchange.headers``); :func:`check` then decides, synchronously and
        before anything is read from the body, whether the request is refused outright.
Rule 2: the checks run in a fixed order (path, CORS preflight, control token, API key,
        content type) and the first refusal answers; every refusal is a whole :class:`Reply` from
        :mod:`inference_lab.serve.error_replies`.
Rule 3: the control plane (``/control/*``, and vLLM's development routes
        :data:`DEV_PATHS`) answers CORS -- headers and preflights -- only
        when the server has a control token: without one its only guard is that the
        client is on loopback, which a page in a local browser is.
Rule 4: the API key guards every path but :data:`OPEN_PATHS` and the control plane (which
        has its own token).
Rule 5: a browser cannot put a header on a page it navigates to or on an ``EventSource``,
        so a ``GET`` under :data:`DASHBOARD_PREFIX` may carry the control token as the query
        argument ``token`` instead; it is compared as the header's would be.
Rule 6: a POST must declare a JSON body, except a bodiless POST without an ``Origin``
        header on the paths vLLM's clients POST to bare (:data:`BODILESS_PATHS`).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from urllib.parse import parse_qs

from inference_lab.api.encoding import new_request_id, random_hex
from inference_lab.serve.completions import COMPLETION_ROUTES
from inference_lab.serve.error_replies import (
    Reply,
    api_key_reply,
    control_forbidden_reply,
    control_unauthorized_reply,
    preflight_reply,
    route_not_found_reply,
    shutting_down_reply,
    unsupported_media_type_reply,
)
from inference_lab.serve.exchange import Exchange
from inference_lab.serve.settings import is_loopback_host
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport import QuickReply

__all__ = ["check", "prepare"]


#: Paths answered without the API key: liveness (``/ping``, SageMaker's), load, version
#: and metrics (scrapers and probes hold no key).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/ping", "/load"})
#: vLLM's development routes (``VLLM_SERVER_DEV_MODE``): the control plane's rules apply
#: to them (Rule 3).
DEV_PATHS = frozenset({"/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping"})
#: Paths vLLM's clients POST to without a body (Rule 6).
BODILESS_PATHS = DEV_PATHS | {"/ping"}
#: Paths whose clients (Anthropic's SDKs) send the API key as ``x-api-key``.
ANTHROPIC_KEY_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
#: The dashboard's paths (``serve/dashboard.py``), where ``?token=`` may stand for the
#: control token's header (Rule 5).
DASHBOARD_PREFIX = "/control/dashboard"
#: The longest client ``x-request-id`` echoed; a longer or unprintable one is replaced.
MAX_REQUEST_ID = 128
#: Response headers a browser page may read (``Access-Control-Expose-Headers``).
_EXPOSED = b"x-request-id, retry-after, x-should-retry"


def _usable_request_id(value: bytes) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.decode().isprintable()


def _allowed_origin(allowed: Sequence[str], origin: bytes) -> bytes | None:
    """The ``Access-Control-Allow-Origin`` value for a request from ``origin``, or None
    when that origin is not allowed."""
    if "*" in allowed:
        return b"*"
    if not origin.isascii():
        return None
    return origin if origin.decode().lower() in allowed else None


def _is_control(path: str) -> bool:
    return path.startswith("/control/") or path == "/control" or path in DEV_PATHS


def _cors_allowed(state: ServeState, exchange: Exchange) -> Sequence[str]:
    """The origins this request may be answered with CORS for (Rule 3)."""
    if state.settings.control_token is None and _is_control(exchange.path):
        return ()
    return state.settings.allowed_origins


def prepare(state: ServeState, exchange: Exchange) -> None:
    """Set the headers every answer to ``exchange`` carries: ``x-request-id`` (the
    client's when it is 1-128 printable ASCII characters, else the id generated here,
    ``Exchange.request_id``, which a completion's body carries as its ``id``), and the
    CORS headers when the request comes from an allowed origin (``--allowed-origins``)."""
    kind = COMPLETION_ROUTES.get(exchange.path)
    generated = new_request_id(kind) if kind is not None else f"req-{random_hex()}"
    exchange.request_id = generated
    client_id: bytes | None = None
    origin: bytes | None = None
    for name, value in exchange.scope["headers"]:
        if name == b"x-request-id":
            if client_id is None:
                client_id = bytes(value)
        elif name == b"origin":
            origin = bytes(value)
    headers = exchange.headers
    if client_id is not None and _usable_request_id(client_id):
        headers.append((b"x-request-id", client_id))
    else:
        headers.append((b"x-request-id", generated.encode()))
    allowed = _cors_allowed(state, exchange)
    if allowed and origin is not None:
        allow = _allowed_origin(allowed, origin)
        if allow is not None:
            headers.append((b"access-control-allow-origin", allow))
            headers.append((b"access-control-expose-headers", _EXPOSED))
            if allow != b"*":
                headers.append((b"vary", b"origin"))


def _path(state: ServeState, exchange: Exchange) -> Reply | None:
    """A path that is not canonical (an empty segment, or no leading ``/``) is a 404
    here: no lookup behind the gate normalises paths, and Werkzeug's slash merging would
    answer a redirect whose ``Location`` is built from the client's ``Host``."""
    path = exchange.path
    if path[:1] != "/" or "//" in path:
        return route_not_found_reply(exchange.method, path)
    return None


def _preflight(state: ServeState, exchange: Exchange) -> Reply | None:
    """A CORS preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
    from an allowed origin is answered here, before the API key (a preflight carries no
    credentials). From any other origin it goes on like any request and its answer has
    no CORS headers, so the browser refuses the real request."""
    allowed = _cors_allowed(state, exchange)
    if exchange.method != "OPTIONS" or not allowed:
        return None
    origin = exchange.header(b"origin")
    if origin is None or exchange.header(b"access-control-request-method") is None:
        return None
    if _allowed_origin(allowed, origin) is None:
        return None
    return preflight_reply(exchange.header(b"access-control-request-headers"))


def _host_name(header: bytes) -> str:
    """The host of a ``Host`` header value, without its port (IPv6 unbracketed)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _control_token(state: ServeState, exchange: Exchange) -> Reply | None:
    """``/control/*`` with a control token: ``Authorization: Bearer <token>`` (401 when
    missing, 403 when wrong; compared in constant time). Without one: only a loopback
    client that names the server by a loopback host (a DNS-rebinding page names it by the
    attacker's domain) is answered, others get 403."""
    if not _is_control(exchange.path):
        return None
    token = state.settings.control_token
    if token is None:
        client = exchange.scope.get("client")
        host = exchange.header(b"host")
        if (client and not is_loopback_host(str(client[0]))) or (
            host is not None and not is_loopback_host(_host_name(host))
        ):
            return control_forbidden_reply(
                "The control endpoints answer only loopback clients addressing a loopback "
                "host unless the server has a control token (--control-token)"
            )
        return None
    authorization = exchange.header(b"authorization")
    if authorization is None and _is_dashboard_get(exchange):
        credentials = _query_token(exchange)  # Rule 5
        if credentials is None:
            return control_unauthorized_reply()
    else:
        scheme, _, credentials = (authorization or b"").strip().partition(b" ")
        credentials = credentials.strip()
        if scheme.lower() != b"bearer" or not credentials:
            return control_unauthorized_reply()
    if not hmac.compare_digest(credentials, token.encode()):
        return control_forbidden_reply("The control token is not valid")
    return None


def _is_dashboard_get(exchange: Exchange) -> bool:
    path = exchange.path
    return exchange.method == "GET" and (
        path == DASHBOARD_PREFIX or path.startswith(DASHBOARD_PREFIX + "/")
    )


def _query_token(exchange: Exchange) -> bytes | None:
    """The ``token`` query argument (its first value), or None when there is none."""
    query = bytes(exchange.scope.get("query_string", b"")).decode("latin-1")
    try:
        values = parse_qs(query, max_num_fields=16).get("token")
    except ValueError:  # more fields than any page of ours sends
        return None
    if not values or not values[0]:
        return None
    return values[0].encode("latin-1", errors="replace")


def _api_key(state: ServeState, exchange: Exchange) -> Reply | None:
    """With an API key (``--api-key``), every path but :data:`OPEN_PATHS` and the control
    plane needs ``Authorization: Bearer <key>`` (on the Messages API's paths, Anthropic's
    ``x-api-key: <key>`` too), compared in constant time; 401 ``invalid_api_key``
    otherwise (Rule 4)."""
    key = state.settings.api_key
    path = exchange.path
    if key is None or path in OPEN_PATHS or _is_control(path):
        return None
    scheme, _, credentials = (exchange.header(b"authorization") or b"").strip().partition(b" ")
    credentials = credentials.strip()
    if scheme.lower() != b"bearer" and path in ANTHROPIC_KEY_PATHS:
        scheme, credentials = b"bearer", (exchange.header(b"x-api-key") or b"").strip()
    if scheme.lower() != b"bearer" or not credentials:
        return api_key_reply(provided=False)
    if not hmac.compare_digest(credentials, key.encode()):
        return api_key_reply(provided=True)
    return None


def _bodiless(exchange: Exchange) -> bool:
    """A request that declares no body: no ``Transfer-Encoding`` and a ``Content-Length``
    of 0 or none."""
    if exchange.header(b"transfer-encoding") is not None:
        return False
    length = exchange.header(b"content-length")
    return length is None or length.strip() == b"0"


def _content_type(state: ServeState, exchange: Exchange) -> Reply | None:
    """A POST body must be declared ``application/json`` (parameters such as ``charset``
    allowed): a browser page can send ``text/plain``, form and untyped bodies without a
    CORS preflight, never a JSON one. 415 otherwise. vLLM's bodiless POSTs (``/sleep``
    and the other :data:`BODILESS_PATHS`, their arguments in the query) pass without one
    when they carry no ``Origin`` header: a browser sends one with every cross-origin
    POST, vLLM's clients (an HTTP library) send none (Rule 6)."""
    if exchange.method != "POST":
        return None
    if (
        exchange.path in BODILESS_PATHS
        and _bodiless(exchange)
        and exchange.header(b"origin") is None
    ):
        return None
    value = exchange.header(b"content-type")
    if value is None or value.partition(b";")[0].strip().lower() != b"application/json":
        return unsupported_media_type_reply(value)
    return None


_CHECKS = (_path, _preflight, _control_token, _api_key, _content_type)


def check(state: ServeState, exchange: Exchange) -> Reply | None:
    """The refusal of ``exchange``, or None to let its route answer it."""
    for rule in _CHECKS:
        reply = rule(state, exchange)
        if reply is not None:
            return reply
    return None


def refusal(state: ServeState, exchange: Exchange) -> Reply | None:
    """What ``exchange`` (prepared) is answered before its route: the 503 of a server
    shutting down, else :func:`check`'s refusal; None to let its route answer it."""
    return shutting_down_reply() if state.draining else check(state, exchange)


def quick_reply(state: ServeState, exchange: Exchange, answer: Callable[[], Reply]) -> QuickReply:
    """The whole answer to a request the connection answers where it reads it
    (``transport.quick``): ``exchange`` prepared and gated as every request is, then
    ``answer()`` unless the gate refused it."""
    prepare(state, exchange)
    reply = refusal(state, exchange)
    if reply is None:
        reply = answer()
    return QuickReply(reply.status, reply.header_list(exchange.headers), reply.body)
