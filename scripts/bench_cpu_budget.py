"""The per-request CPU budget of ``inference-lab serve``: microseconds of the server's CPU
per request, from accept to last byte, and where they go.

Starts ``inference-lab serve`` (gpt-oss-20b on b200 by default: prefix caching, the
dashboard and ``/metrics`` on, as shipped) in its own process, opens the dashboard's event
stream (``/control/dashboard/events``, as an open page does) and scrapes ``/metrics``
every second for the whole run, then for each case sends ``--requests`` chat completions
from ``--concurrency`` closed-loop clients on keep-alive connections:

- ``200 B``: one user message of 200 bytes;
- ``16 KB``: a conversation of 16 KB (a system prompt and seven turns) whose last user
  message changes from request to request, so its prefix is cached;

each streamed and not (``max_tokens`` ``--max-tokens``, every answer run to it with
``ignore_eos``). A case's CPU is the server process's user + system time over the case
(``/proc/PID/stat``), divided by the requests it served: it includes what runs beside
the requests (the dashboard's sampler, the scrapes, the pacer), which the idle line
measures alone. With py-spy installed (``pip install py-spy``) each case is also sampled
(``py-spy record --nonblocking``, idle samples left out) and the script prints where each
microsecond goes: by area of the code, and the functions with the most samples of their
own, each sample's share of the case's CPU turned into microseconds per request.

    python scripts/bench_cpu_budget.py                         # the four cases
    python scripts/bench_cpu_budget.py --cases 200B-stream --requests 2000
    python scripts/bench_cpu_budget.py --no-profile            # CPU only

Only 127.0.0.1 is contacted; every case is bounded in time (``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import attrs
import trio
from benchkit import ServerProcess, scrape_loop

from inference_lab.core.config import load_deployment
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir

CASES = ("200B-stream", "200B", "16KB-stream", "16KB")
TICK = os.sysconf("SC_CLK_TCK")

#: Where a sampled frame's file puts its time (first match wins).
AREAS: tuple[tuple[str, str], ...] = (
    ("inference_lab/core/", "engine (core: scheduler, KV, roofline)"),
    ("inference_lab/runtime/", "runtime (engine task, pacer)"),
    ("inference_lab/api/", "api (parse, template, hash, encode)"),
    ("inference_lab/serve/streaming", "serve: stream writes"),
    ("inference_lab/serve/transport", "serve: transport (hypercorn hooks)"),
    ("inference_lab/serve/metrics", "serve: metrics"),
    ("inference_lab/serve/engine_series", "serve: metrics"),
    ("inference_lab/serve/dashboard", "serve: dashboard"),
    ("inference_lab/serve/", "serve: routes, admission, gate"),
    ("inference_lab/", "inference_lab, other"),
    ("(h11/", "h11 (HTTP/1.1 parsing)"),
    ("(hypercorn/", "hypercorn"),
    ("(quart", "quart"),
    ("(trio/", "trio (scheduler, sockets)"),
    ("(prometheus_client/", "prometheus_client"),
    ("(tokenizers/", "tokenizers"),
    ("(numpy/", "numpy"),
)


@attrs.frozen
class CaseResult:
    name: str
    requests: int
    tokens: int
    wall: float
    cpu: float  # server process seconds (user + system)
    samples: Counter[str]  # py-spy: leaf frame -> samples (empty without profiling)
    areas: Counter[str]

    @property
    def us_per_request(self) -> float:
        return self.cpu / self.requests * 1e6 if self.requests else float("nan")


def process_cpu(pid: int) -> float:
    """User + system seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def chat_body(model: str, case: str, index: int, max_tokens: int) -> bytes:
    """The JSON body of request ``index`` of ``case``."""
    tail = f" request {index:08d}"
    if case.startswith("200B"):
        messages = [{"role": "user", "content": "x" * (200 - len(tail)) + tail}]
    else:
        turn = "lorem ipsum dolor sit amet " * 74  # ~2 KB
        messages = [{"role": "system", "content": "You are helpful. " + turn}]
        for k in range(3):
            messages.append({"role": "user", "content": f"question {k}: " + turn})
            messages.append({"role": "assistant", "content": f"answer {k}: " + turn})
        messages.append({"role": "user", "content": "and now" + tail + ": " + turn})
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": case.endswith("stream"),
    }
    return json.dumps(body).encode()


def http_request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def read_answer(stream: trio.SocketStream, buf: bytearray) -> int:
    """Read one whole HTTP/1.1 answer (chunked or with a content-length) from ``stream``
    (``buf`` holds what was read past the previous one); its status."""
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    head_end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:head_end]).lower()
    status = int(head[9:12])
    if b"transfer-encoding: chunked" in head:
        while True:
            end = buf.find(b"\r\n0\r\n\r\n", head_end - 2)
            if end >= 0:
                del buf[: end + 7]
                return status
            chunk = await stream.receive_some(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            buf += chunk
    length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    while len(buf) < head_end + length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    del buf[: head_end + length]
    return status


async def client(
    port: int, model: str, case: str, indices: range, max_tokens: int, done: list[int]
) -> None:
    """One closed-loop client on one keep-alive connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    buf = bytearray()
    try:
        for i in indices:
            await stream.send_all(
                http_request("/v1/chat/completions", chat_body(model, case, i, max_tokens))
            )
            status = await read_answer(stream, buf)
            if status != 200:
                raise RuntimeError(f"{case}: request {i} answered HTTP {status}")
            done.append(i)
    finally:
        await stream.aclose()


async def dashboard_reader(port: int, model: str) -> None:
    """An open dashboard page: the event stream, read until cancelled."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await stream.send_all(
            f"GET /control/dashboard/events?model={model} HTTP/1.1\r\n"
            "host: 127.0.0.1\r\naccept: text/event-stream\r\n\r\n".encode()
        )
        while await stream.receive_some(65536):
            pass
    finally:
        await stream.aclose()


def start_profile(pid: int, out: Path, rate: int) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return None
    cmd = [spy, "record", "--pid", str(pid), "--rate", str(rate), "--nonblocking"]
    cmd += ["--format", "raw", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(proc: subprocess.Popen[bytes], out: Path) -> tuple[Counter[str], Counter[str]]:
    """Stop py-spy (it writes its file on SIGINT); the samples by leaf function and by
    area."""
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    leaves: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    if not out.exists():
        return leaves, areas
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        leaves[_short(frames[-1])] += int(count)
        areas[_area(frames)] += int(count)
    return leaves, areas


def _short(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (file.py)``."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({file})"


def _area(frames: list[str]) -> str:
    """The area of the innermost frame that is in one (stdlib frames count for their
    caller's area: ``json`` under the parser is the parser's)."""
    for frame in reversed(frames):
        for needle, area in AREAS:
            if needle in frame:
                return area
    return "python stdlib, other"


async def run_case(
    port: int, pid: int, case: str, args: argparse.Namespace, workdir: Path
) -> CaseResult:
    # warm the case's path (and the prefix cache with its conversation) first
    async with trio.open_nursery() as nursery:
        for c in range(min(4, args.concurrency)):
            nursery.start_soon(
                client, port, args.model, case, range(10**6 + c, 10**6 + c + 1), 4, []
            )
    out = workdir / f"{case}.txt"
    spy = None if args.no_profile else start_profile(pid, out, args.rate)
    if spy is not None:
        await trio.sleep(1.0)  # py-spy attaches
    done: list[int] = []
    cpu0, t0 = process_cpu(pid), time.perf_counter()
    with trio.fail_after(args.timeout):
        async with trio.open_nursery() as nursery:
            for c in range(args.concurrency):
                nursery.start_soon(
                    client, port, args.model, case, range(c, args.requests, args.concurrency),
                    args.max_tokens, done,
                )  # fmt: skip
    cpu1, t1 = process_cpu(pid), time.perf_counter()
    leaves, areas = stop_profile(spy, out) if spy is not None else (Counter(), Counter())
    return CaseResult(
        case, len(done), len(done) * args.max_tokens, t1 - t0, cpu1 - cpu0, leaves, areas
    )


def print_budget(results: list[CaseResult], idle_us_per_s: float, args: argparse.Namespace) -> None:
    print(
        f"\nper-request CPU of the server ({args.model}, {args.concurrency} closed-loop clients, "
        f"{args.max_tokens} tokens per answer; dashboard open, /metrics every 1 s)"
    )
    print(f"{'case':<14}{'requests':>9}{'wall s':>8}{'CPU s':>8}{'us/request':>12}{'us/token':>10}")
    for r in results:
        print(
            f"{r.name:<14}{r.requests:>9}{r.wall:>8.1f}{r.cpu:>8.2f}{r.us_per_request:>12.0f}"
            f"{r.cpu / max(1, r.tokens) * 1e6:>10.1f}"
        )
    print(f"background with no requests (sampler, scrapes): {idle_us_per_s:.0f} us of CPU per s")
    print(f"load average (uptime) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    profiled = [r for r in results if r.samples]
    if not profiled:
        if not args.no_profile:
            print("(no profile: py-spy is not installed; pip install py-spy)")
        return
    print("\nwhere each request's microseconds go, by area (py-spy samples x us/request):")
    names = [r.name for r in profiled]
    print(f"{'area':<40}" + "".join(f"{n:>14}" for n in names))
    all_areas = Counter[str]()
    for r in profiled:
        all_areas.update({k: v / r.areas.total() for k, v in r.areas.items()})
    for area, _ in all_areas.most_common():
        row = "".join(
            f"{r.areas[area] / r.areas.total() * r.us_per_request:>14.0f}" for r in profiled
        )
        print(f"{area:<40}{row}")
    for r in profiled:
        total = r.samples.total()
        print(f"\n{r.name}: top functions by own samples ({total} samples)")
        for leaf, count in r.samples.most_common(args.top):
            share = count / total
            print(f"  {share:6.1%} {share * r.us_per_request:8.0f} us  {leaf}")


async def main_async(args: argparse.Namespace, port: int, pid: int) -> None:
    stop = trio.Event()
    latencies: list[float] = []
    sizes: list[int] = []
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="cpu-budget-") as tmp_dir:
        tmp = args.keep or tmp_dir
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dashboard_reader, port, args.model)
            nursery.start_soon(scrape_loop, f"http://127.0.0.1:{port}", "/metrics", 1.0, stop,
                               latencies, sizes)  # fmt: skip
            await trio.sleep(1.0)
            cpu0, t0 = process_cpu(pid), time.perf_counter()
            await trio.sleep(args.idle)
            idle = (process_cpu(pid) - cpu0) / (time.perf_counter() - t0) * 1e6
            for case in args.cases:
                results.append(await run_case(port, pid, case, args, Path(tmp)))
                print(f"{case}: {results[-1].us_per_request:.0f} us/request", file=sys.stderr)
            stop.set()
            nursery.cancel_scope.cancel()
    print_budget(results, idle, args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt-oss-20b", help="model config (shipped name)")
    parser.add_argument("--hardware", default="b200")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--requests", type=int, default=480, help="per case")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of the idle line")
    parser.add_argument("--timeout", type=float, default=300.0, help="per case (s)")
    parser.add_argument("--no-profile", action="store_true", help="CPU only, no py-spy")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=12, help="functions listed per case")
    parser.add_argument(
        "--keep", metavar="DIR", help="keep py-spy's raw stacks here (CASE.txt, collapsed)"
    )
    args = parser.parse_args(argv)
    for flag in ("requests", "concurrency", "max_tokens", "rate", "top"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.requests < args.concurrency:
        parser.error("--requests must be at least --concurrency")
    path = Path(args.config)
    if not path.exists():
        path = shipped_dir("configs") / f"{args.config}.toml"
    try:
        args.model = load_deployment(path, args.hardware).model.name
    except ConfigError as exc:
        parser.exit(2, f"bench_cpu_budget: {exc}\n")
    args.config = str(path)
    if args.keep is not None and not Path(args.keep).is_dir():
        parser.exit(2, f"bench_cpu_budget: --keep: no such directory: {args.keep}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with ServerProcess(["--config", args.config, "--hardware", args.hardware]) as server:
        assert server.proc is not None
        port = int(server.url.rsplit(":", 1)[1])
        print(f"load average at the start: {os.getloadavg()}", file=sys.stderr)
        trio.run(main_async, args, port, server.proc.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
