"""Fuzz: hypothesis-generated requests and raw protocol junk against a live server.

Five families, each a hypothesis test run for ``--cases`` examples (no shrinking: every
case is judged and counted, failures are listed):

- ``json``: JSON values and request-shaped objects (OpenAI fields with wild values: huge
  numbers, lone surrogates, deep nesting, wrong types) on every POST endpoint;
- ``bytes``: arbitrary bytes declared ``application/json``;
- ``nested``: arrays and objects nested 1 .. 200,000 deep;
- ``http``: well-formed HTTP/1.1 with odd methods, paths (``//``, ``..``, unicode,
  percent-escapes), content types, ``Host`` and ``Authorization`` headers;
- ``junk``: raw bytes and broken HTTP (bad request lines, bad Content-Length, bad chunk
  sizes, header floods, ``Transfer-Encoding: gzip``, an HTTP/2 preface).

A case fails when the answer is a 5xx, when a well-formed request gets no answer or an
error that is not a JSON envelope, or when a 200 stream is cut short. Protocol junk may
be answered by hypercorn itself (a 4xx with an empty body) or by closing the connection.
After each family the server must be healthy and hold nothing; at the end its log must
have no traceback. Prints cases, failures, statuses, leaked slots, RSS before/after.

    python scripts/stress/fuzz.py                 # 300 cases per family
    python scripts/stress/fuzz.py --cases 2000 --seconds 600

Only 127.0.0.1; each case is bounded (2 s), each family by ``--seconds``.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # benchkit

from common import (  # noqa: E402
    MODEL,
    Response,
    fetch,
    get,
    leaks,
    log_problems,
    read_response,
    report,
    rss_mb,
    server,
    settle,
)

POST_PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/control/capacity",
    "/tokenize",
    "/detokenize",
]
#: Seconds one case may take (a 200 stream still running then is closed by us: fine).
CASE_SECONDS = 2.0

# -- strategies -------------------------------------------------------------------------------

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.one_of(surrogates, st.characters()), max_size=10),
    st.sampled_from([MODEL, "", "user", "system", "assistant", "tool", "x" * 5000]),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 10**29, 2**31, 2**63, 10**7]),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(texts, inner, max_size=5)),
    max_leaves=25,
)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": texts}
        ),
        json_values,
    ),
    max_size=4,
)
FIELDS: dict[str, Any] = {
    "model": st.one_of(st.just(MODEL), texts, json_values),
    "messages": st.one_of(messages, json_values),
    "prompt": st.one_of(texts, st.lists(st.integers(-5, 2**40), max_size=5), json_values),
    "max_tokens": st.one_of(st.integers(-3, 40), numbers, json_values),
    "max_completion_tokens": numbers,
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": json_values,
    "n": st.one_of(st.integers(-2, 4), numbers),
    "stop": st.one_of(texts, st.lists(texts, max_size=6), json_values),
    "temperature": numbers,
    "priority": numbers,
    "logprobs": json_values,
    "tools": json_values,
    "max_num_seqs": numbers,
    "max_waiting": numbers,
    "tokens": st.one_of(st.lists(st.integers(-5, 2**40), max_size=5), json_values),
    "add_special_tokens": json_values,
}
request_objects = st.fixed_dictionaries({}, optional={k: v for k, v in FIELDS.items()}).map(
    lambda d: {**d, "max_tokens": d.get("max_tokens", 4)} if "messages" in d else d
)


def encode(value: Any, ascii_only: bool) -> bytes:
    """JSON text of ``value``; lone surrogates become ``\\udXXX`` escapes either way."""
    text = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)
    return text.encode("utf-8", "backslashreplace")


# -- the client -------------------------------------------------------------------------------


def http_request(
    method: str, path: str, body: bytes, headers: dict[str, str] | None = None
) -> bytes:
    head = {"host": "127.0.0.1", "content-type": "application/json", "connection": "close"}
    head.update(headers or {})
    lines = [f"{method} {path} HTTP/1.1"]
    lines += [f"{k}: {v}" for k, v in head.items()]
    if body or method == "POST":
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def send_raw(port: int, data: bytes, *, half_close: bool = False) -> Response:
    """A blocking exchange: send ``data`` (then end our side of the connection if
    ``half_close``: junk that is an incomplete request is then judged at once), read until
    close or :data:`CASE_SECONDS`."""
    received = bytearray()
    deadline = time.monotonic() + CASE_SECONDS
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=CASE_SECONDS) as sock:
            try:
                sock.sendall(data)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server may answer (and close) before reading everything
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
    except (TimeoutError, OSError):
        pass
    return read_response(bytes(received))


class Judge:
    """Counts cases, statuses and failures of one family."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name = name
        self.cases = 0
        self.statuses: collections.Counter[int] = collections.Counter()
        self.failures: list[str] = []
        self.deadline = time.monotonic() + seconds

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def well_formed(self, response: Response, what: str) -> None:
        """A well-formed request: an answer, below 500, errors as JSON envelopes, 200
        streams complete unless still running when the case's time ran out."""
        self.cases += 1
        self.statuses[response.status] += 1
        problem = None
        if response.status == 0:
            problem = "no answer"
        elif response.status >= 500:
            problem = f"HTTP {response.status}: {response.body[:200]!r}"
        elif response.status >= 400 and not what.startswith("HEAD "):
            try:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["type"]
            except Exception:  # noqa: BLE001 - any shape problem is the finding
                problem = f"HTTP {response.status} not an error envelope: {response.raw[:200]!r}"
            if response.headers.get("content-type") != "application/json":
                problem = f"HTTP {response.status} content-type {response.headers}"
        if problem is not None:
            self.failures.append(f"{what[:160]!r}: {problem}")

    def junk(self, response: Response, what: bytes) -> None:
        """Protocol junk: no answer (closed) or any answer below 500, except hypercorn's
        501 for a transfer coding other than chunked (RFC 9112 asks for exactly that)."""
        self.cases += 1
        self.statuses[response.status] += 1
        if response.status == 501 and b"transfer-encoding" in what.lower():
            return
        if response.status >= 500:
            self.failures.append(f"{what[:160]!r}: HTTP {response.status}")


def run_family(
    judge: Judge, strategy: st.SearchStrategy[Any], case: Callable[[Any], None], cases: int
) -> None:
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def family(value: Any) -> None:
        if not judge.out_of_time():
            case(value)

    family()


def families(port: int, cases: int, seconds: float) -> list[Judge]:
    judges = []

    judge = Judge("json", seconds)

    def json_case(drawn: tuple[str, Any, bool]) -> None:
        path, value, ascii_only = drawn
        body = encode(value, ascii_only)
        judge.well_formed(send_raw(port, http_request("POST", path, body)), f"{path} {body!r}")

    strategy = st.tuples(
        st.sampled_from(POST_PATHS), st.one_of(request_objects, json_values), st.booleans()
    )
    run_family(judge, strategy, json_case, cases)
    judges.append(judge)

    judge_b = Judge("bytes", seconds)

    def bytes_case(drawn: tuple[str, bytes]) -> None:
        path, body = drawn
        judge_b.well_formed(send_raw(port, http_request("POST", path, body)), f"{path} {body!r}")

    run_family(
        judge_b, st.tuples(st.sampled_from(POST_PATHS), st.binary(max_size=300)), bytes_case, cases
    )
    judges.append(judge_b)

    judge_n = Judge("nested", seconds)

    def nested_case(drawn: tuple[str, int, bool]) -> None:
        path, depth, objects = drawn
        body = b'{"a":' * depth + b"1" + b"}" * depth if objects else b"[" * depth + b"]" * depth
        judge_n.well_formed(
            send_raw(port, http_request("POST", path, body)), f"{path} depth {depth}"
        )

    strategy_n = st.tuples(st.sampled_from(POST_PATHS), st.integers(1, 200_000), st.booleans())
    run_family(judge_n, strategy_n, nested_case, max(10, cases // 10))
    judges.append(judge_n)

    judge_h = Judge("http", seconds)
    paths = st.one_of(
        st.sampled_from(
            [*POST_PATHS, "/health", "/v1/models", "/control/stats", "/metrics", "/version"]
        ),
        st.sampled_from(["//v1//chat//completions", "/v1/../v1/models", "/%2e%2e/", "/v1/models/"]),
        st.text(alphabet="/abcv1.%-_~?&=#", min_size=1, max_size=40).map(lambda p: "/" + p),
        st.text(min_size=1, max_size=20).map(lambda p: "/" + p.replace("\r", "").replace("\n", "")),
    )
    header_values = st.text(
        alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40
    )
    extra_headers = st.fixed_dictionaries(
        {},
        optional={
            "content-type": st.one_of(
                st.sampled_from(
                    [
                        "text/plain",
                        "application/x-www-form-urlencoded",
                        "multipart/form-data; boundary=x",
                        "application/json; charset=utf-8",
                        "",
                    ]
                ),
                header_values,
            ),
            "host": st.one_of(
                st.sampled_from(["evil.example", "[::1]:1", "localhost"]), header_values
            ),
            "authorization": header_values,
            "origin": header_values,
        },
    )

    def http_case(drawn: tuple[str, str, dict[str, str], Any]) -> None:
        method, path, headers, value = drawn
        body = encode(value, True) if method in ("POST", "PUT", "PATCH") else b""
        raw = http_request(method, path, body, headers)
        if all(0x21 <= ord(c) <= 0x7E for c in path):
            judge_h.well_formed(send_raw(port, raw), raw.decode("utf-8", "replace"))
        else:  # not a valid request target: the protocol layer may refuse it bare
            judge_h.junk(send_raw(port, raw, half_close=True), raw)

    strategy_h = st.tuples(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "FOO"]),
        paths,
        extra_headers,
        st.one_of(request_objects, json_values),
    )
    run_family(judge_h, strategy_h, http_case, cases)
    judges.append(judge_h)

    judge_j = Judge("junk", seconds)
    templates = st.sampled_from(
        [
            b"GET / HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1e3\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello",
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"GET / HTTP/1.1\r\n" + b"x-flood: a\r\n" * 3000 + b"\r\n",
            b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nhost: x\r\n\r\n",
            b"GET http://evil.example/health HTTP/1.1\r\nhost: x\r\n\r\n",
            b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n",
            b"GET /health HTTP/1.0\r\n\r\n",
            b"GET /health HTTP/9.9\r\nhost: x\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        ]
    )
    junk_bytes = st.one_of(
        templates,
        st.binary(max_size=400),
        st.tuples(templates, st.binary(max_size=40), st.integers(0, 200)).map(
            lambda t: t[0][: t[2]] + t[1] + t[0][t[2] :]
        ),
    )

    def junk_case(data: bytes) -> None:
        judge_j.junk(send_raw(port, data, half_close=True), data)

    run_family(judge_j, junk_bytes, junk_case, cases)
    judges.append(judge_j)
    return judges


async def check_after(url: str, port: int) -> tuple[int, dict[str, int]]:
    health = await fetch(port, get("/health"), 5)
    with trio.move_on_after(15):
        await settle(url)
    return health.status, await leaks(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="examples per family")
    parser.add_argument("--seconds", type=float, default=60.0, help="time bound per family")
    args = parser.parse_args(argv)
    with server(["--default-max-tokens", "8"]) as srv:
        rss_before = rss_mb(srv.pid)
        judges = families(srv.port, args.cases, args.seconds)
        health, held = trio.run(check_after, srv.url, srv.port)
        rss_after = rss_mb(srv.pid)
        code = srv.stop()
        problems = log_problems(srv.log_text())
    failures = [f"{j.name}: {f}" for j in judges for f in j.failures]
    for line in failures[:20]:
        print("  failure:", line, file=sys.stderr)
    for line in problems[:20]:
        print("  log:", line, file=sys.stderr)
    ok = not failures and not problems and health == 200 and not any(held.values())
    ok = ok and code == 0
    report(
        "fuzz",
        {
            "cases": {j.name: j.cases for j in judges},
            "failures": {j.name: len(j.failures) for j in judges},
            "statuses": dict(
                sorted(sum((j.statuses for j in judges), collections.Counter()).items())
            ),
            "health_after": health,
            "leaked": held,
            "rss_mb_before_after": [round(rss_before, 1), round(rss_after, 1)],
            "log_problems": len(problems),
            "exit_code": code,
        },
        ok,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
