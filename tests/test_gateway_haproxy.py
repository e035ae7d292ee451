"""HAProxy (Debian's ``haproxy``) in front of ``serve --data-parallel-size 2``
(``docs/data-parallel.md``): the configuration the docs show, generated here on loopback.

Traffic through it reaches both ranks; a 529 passes through as the rank sent it (status,
body, ``Retry-After``, ``x-should-retry``), so an adaptive client behind the balancer
still sees the refusal; a killed rank is taken out by the health check on ``/health``
and comes back once the parent restarted it. Skips where ``haproxy`` is not installed
(``.ci/run`` installs it).
"""

from __future__ import annotations

import csv
import http.client
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import GPT
from .test_serve_ranks import Fleet, _gone

HAPROXY = shutil.which("haproxy") or (
    "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
)
pytestmark = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (Debian: apt-get install haproxy)"
)

CONFIG = """\
global
    maxconn 4096

defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    timeout check 1s

frontend inference
    bind 127.0.0.1:{front}
    default_backend ranks

backend ranks
    balance {balance}
    option httpchk GET /health
    http-check expect status 200
    default-server inter 200ms fall 2 rise 2
{servers}

frontend stats
    bind 127.0.0.1:{stats}
    stats enable
    stats uri /stats
"""


def haproxy_config(front: int, stats: int, ranks: list[str], balance: str = "leastconn") -> str:
    """The configuration ``docs/data-parallel.md`` shows, for ranks at ``ranks`` (URLs)."""
    servers = "\n".join(
        f"    server rank{r} {url.removeprefix('http://')} check" for r, url in enumerate(ranks)
    )
    return CONFIG.format(front=front, stats=stats, balance=balance, servers=servers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HAProxy:
    def __init__(self, tmp: Path, ranks: list[str]) -> None:
        self.front, self.stats = free_port(), free_port()
        cfg = tmp / "haproxy.cfg"
        cfg.write_text(haproxy_config(self.front, self.stats, ranks))
        assert HAPROXY is not None
        check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr + check.stdout
        self.proc = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def status(self) -> dict[str, str]:
        """Each server's state on HAProxy's stats page (``UP``, ``DOWN``, ...)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.stats, timeout=5)
        conn.request("GET", "/stats;csv")
        text = conn.getresponse().read().decode().lstrip("# ")
        conn.close()
        rows = csv.DictReader(io.StringIO(text))
        return {
            row["svname"]: row["status"].split()[0]
            for row in rows
            if row["pxname"] == "ranks" and row["svname"].startswith("rank")
        }

    def wait_for(self, states: dict[str, str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                seen = self.status()
            except OSError:
                seen = {}
            if all(seen.get(k) == v for k, v in states.items()):
                return
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def complete(port: int, max_tokens: int = 4) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": GPT, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    headers = {k.lower(): v for k, v in response.getheaders()}
    data = response.read()
    conn.close()
    return response.status, headers, data


def hold_stream(port: int) -> socket.socket:
    """A long streaming request whose answer is not read: it holds a seat or a place."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps(
        {"model": GPT, "prompt": "x", "max_tokens": 100000, "ignore_eos": True, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    assert sock.recv(12) == b"HTTP/1.1 200"
    return sock


def request_count(url: str) -> float:
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def test_haproxy_balances_passes_529_through_and_health_checks_the_ranks(tmp_path: Path) -> None:
    fleet = Fleet("--data-parallel-size", "2", "--max-num-seqs", "1", "--max-waiting", "1")
    proxy = None
    held: list[socket.socket] = []
    try:
        fleet.banner()
        proxy = HAProxy(tmp_path, fleet.urls)
        proxy.wait_for({"rank0": "UP", "rank1": "UP"})

        for _ in range(6):  # leastconn: idle ranks share the requests in turn
            assert complete(proxy.front)[0] == 200
        assert all(request_count(url) >= 1 for url in fleet.urls)

        # fill both ranks (one running, one waiting each), then one more through HAProxy
        for _ in range(4):
            held.append(hold_stream(proxy.front))
        status, headers, body = complete(proxy.front)
        direct = complete(int(fleet.urls[0].rsplit(":", 1)[1]))
        assert status == direct[0] == 529
        assert body == direct[2]
        assert json.loads(body)["error"]["code"] == "queue_saturated"
        assert headers["x-should-retry"] == "false"
        assert int(headers["retry-after"]) >= 1
        assert int(direct[1]["retry-after"]) >= 1  # an estimate: each refusal its own
        for sock in held:
            sock.close()
        held.clear()

        os.kill(fleet.pids[1], signal.SIGKILL)
        proxy.wait_for({"rank0": "UP", "rank1": "DOWN"})
        for _ in range(4):  # the rank left is the only one sent anything
            assert complete(proxy.front)[0] == 200
        match = fleet.wait_stderr(r"rank 1 restarted: \S+ \(pid (\d+)\)")
        fleet.pids.append(int(match.group(1)))
        proxy.wait_for({"rank0": "UP", "rank1": "UP"})
        assert complete(proxy.front)[0] == 200

        fleet.proc.send_signal(signal.SIGTERM)
        assert fleet.proc.wait(timeout=60) == 0
        assert _gone(fleet.pids)
    finally:
        for sock in held:
            sock.close()
        if proxy is not None:
            proxy.stop()
        fleet.stop()
