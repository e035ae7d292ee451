"""Benchmark: ``serve`` 1P1D behind ``inference-lab proxy`` against the simulator's 1P1D on
the same traffic.

Starts ``inference-lab serve --role prefill`` and ``--role decode`` (the same model config
and hardware entry, one replica each) and ``inference-lab proxy`` in front of them, each in
its own process on 127.0.0.1. Every request is a streaming ``/v1/completions`` request
with a unique ``--prompt``-token prompt, ``ignore_eos`` and ``--output`` tokens; a stream
sends its requests back to back on one keep-alive connection. Then:

0. **Warm-up**: ``--streams`` streams, two requests each, not measured (every
   connection's first use, every process's first requests).
1. **The hop** (calibration): ``--calibration`` requests on one stream. With nothing
   queued, a request's client TTFT differs from the simulator's on the same arrivals
   (1P1D, nothing between the pools but the priced transfer) only by what the deployment
   adds: the proxy's two hops, the HTTP between the three processes, the decode server's
   claim on the prefill server and the first token's way back. The mean difference is
   the hop; the proxy's ``/stats`` says how much of it lies before the prefill (its
   admission probe and first forwarding: the simulator's ``frontend_latency``), the rest
   is the simulator's ``handoff_latency`` (the proxy's hop, as ``docs/disaggregation.md``
   names it).
2. **The run**: ``--streams`` streams, ``--requests`` requests in all. The client's TTFT
   (send -> first token) and E2E (send -> last token) against the simulator's 1P1D with
   that frontend latency and hop on the run's own arrivals (each request arriving when the
   client sent it: the same traffic). Beside it, the simulator's own closed loop of as
   many users: the streams of a model stay in step (they start together and every request
   takes as long), so their prefills queue behind each other in waves, where the served
   streams drift apart -- a different traffic, shown for what it is.

Each request's TTFT and E2E are also compared with the replay's for the same request
(the paired differences), and the TTFT's differences are counted in decode steps around
their median: a request's first token comes at a step boundary of the decode server,
served and simulated, so when the two step grids are out of phase the differences fall
in two bands a step apart, and the paired median (and the p50's error) is whichever band
holds more than half. The p50's error is printed again against replays whose warm-up
arrivals (left out of every figure) come later by fifths of a decode step: their decode
steps start that much later, so the phase alone moves, and the mean of those errors is
the p50's error with the phase averaged out.

Where the TTFT went is printed beside (means over every request of the run, its first
streams' included, as the servers count them): the proxy's stages over the run (``/stats``: its
front, the prefill's round trip, the hand-off, the decode answer's head) and the replay's
(arrival to the prefill's end, the hand-off, the first decode step); the prefill server's
own arrival-to-answer and the decode server's arrival-to-first-token means (their
``/metrics``, engine time) against the replay's; and each server's
mean pacing lag over the run; and the replay again with the proxy's front stage as the
run measured it (the hop grows with the streams on a busy machine).

The transfer is priced on the profile's NIC (``link = "scale_out"``), as a decode server
prices a pull from another server.

    python scripts/bench_pd_serve.py [--config Llama-3.3-70B-Instruct-FP8] [--hardware h200]
        [--prompt 1000] [--output 200] [--streams 16] [--requests 320] [--calibration 20]
        [--no-admission-probe]

Run it on a quiet machine: the three servers and this client share the CPU, and a served
step that starts late (pacing lag) is latency the model does not have; the load average
before and after, each process's CPU and the steal time are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
from benchkit import Result, ServerProcess, machine_steal, one_stream, request_json, steal_pct

from inference_lab.core.config import (
    Deployment,
    DisaggregationConfig,
    disaggregate,
    load_deployment,
)
from inference_lab.core.engine import Engine, Finished, RequestSpec
from inference_lab.errors import ConfigError
from inference_lab.resources import resolve_shipped

#: Seconds the whole run may take before it is abandoned.
RUN_TIMEOUT = 900.0


@attrs.frozen
class Sent:
    """One request as the client sent it: when (seconds from the run's first send) and
    what it measured."""

    at: float
    ttft: float
    e2e: float
    status: int


def pd_deployment(dep: Deployment, frontend: float, handoff: float) -> Deployment:
    """``dep`` split 1P1D over the profile's NIC, with ``frontend`` and ``handoff`` seconds
    of latency (the simulator's view of the served deployment)."""
    dep = attrs.evolve(
        dep, scheduler=attrs.evolve(dep.scheduler, frontend_latency=max(0.0, frontend))
    )
    split = DisaggregationConfig(link="scale_out", handoff_latency=max(0.0, handoff))
    return disaggregate(dep, split, {}, f"{dep.config_path}: bench_pd_serve")


def simulate_arrivals(
    dep: Deployment, arrivals: Sequence[float], prompt: int, output: int
) -> list[Finished]:
    """The simulator on the given arrivals (seconds), in their order."""
    engine = Engine(dep)
    ids = [
        engine.submit(RequestSpec(prompt_tokens=prompt, max_tokens=output, arrival_time=at))
        for at in arrivals
    ]
    done: dict[int, Finished] = {}
    while engine.next_event_time() is not None:
        for f in engine.step().finished:
            done[f.request_id] = f
    return [done[i] for i in ids]


def simulate_closed_loop(
    dep: Deployment, users: int, total: int, prompt: int, output: int
) -> list[Finished]:
    """The simulator's closed loop: ``users`` users each sending the next request as soon as
    its previous one finished, ``total`` requests in all."""
    engine = Engine(dep)
    spec = RequestSpec(prompt_tokens=prompt, max_tokens=output)
    sent = min(users, total)
    for _ in range(sent):
        engine.submit(spec)
    out: list[Finished] = []
    while engine.next_event_time() is not None:
        for f in engine.step().finished:
            out.append(f)
            if sent < total:
                engine.submit(attrs.evolve(spec, arrival_time=f.finish_time))
                sent += 1
    return out


def request_bytes(host: str, model: str, index: int, prompt: int, output: int) -> bytes:
    """A streaming completions request whose prompt counts ``prompt`` tokens by the byte
    rule (``ceil(bytes / 4)``) and is unique (no prefix-cache hit anywhere)."""
    import json

    text = f"{index:08d} " + "x" * (4 * prompt - 9)
    body = json.dumps(
        {"model": model, "prompt": text, "max_tokens": output, "ignore_eos": True, "stream": True}
    ).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def run_streams(
    url: str, model: str, streams: int, total: int, prompt: int, output: int, first: int
) -> list[Sent]:
    """``streams`` closed-loop streams sending ``total`` requests (indices from ``first``)."""
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    results: list[tuple[int, Result]] = []
    counter = iter(range(total))
    t0 = time.perf_counter()

    async def stream_loop() -> None:
        conn = await trio.open_tcp_stream(host, port)
        try:
            for i in counter:
                request = request_bytes(f"{host}:{port}", model, first + i, prompt, output)
                results.append(
                    (i, await one_stream(conn, request, time.perf_counter(), stamped=True))
                )
        finally:
            await conn.aclose()

    with trio.fail_after(RUN_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(stream_loop)
    results.sort(key=lambda item: item[1].start)
    return [Sent(r.start - t0, r.ttft, r.e2e, r.status) for _, r in results]


def cpu_seconds(pid: int) -> float:
    """The user and system CPU seconds process ``pid`` has used (Linux ``/proc``; NaN
    elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _ms(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values) * 1e3, statistics.median(values) * 1e3


def _row(name: str, client: Sequence[float], sims: Sequence[Sequence[float]]) -> str:
    mean, p50 = _ms(client)
    cells = [f"{name:<10} {mean:9.1f} {p50:9.1f}"]
    for sim in sims:
        s_mean, s_p50 = _ms(sim)
        cells.append(
            f"{s_mean:9.1f} {s_p50:9.1f} {(mean - s_mean) / s_mean * 100:+7.1f}% "
            f"{(p50 - s_p50) / s_p50 * 100:+7.1f}%"
        )
    return " | ".join(cells)


def paired_line(name: str, client: Sequence[float], sim: Sequence[float]) -> str:
    """Each request's client figure against the replay's figure for the same request (the
    same arrival): the median, p90 and mean of the differences, in ms and relative to the
    replay's. The distributions' p50s above compare two requests that may differ; this
    compares each request with itself."""
    diffs = sorted(c - s for c, s in zip(client, sim, strict=True))
    rel = sorted((c - s) / s for c, s in zip(client, sim, strict=True))

    def at(values: Sequence[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return (
        f"{name} paired by request (client - sim, same arrival): median {at(diffs, 0.5) * 1e3:+.2f} ms "
        f"({at(rel, 0.5) * 100:+.1f} %), p90 {at(diffs, 0.9) * 1e3:+.2f} ms "
        f"({at(rel, 0.9) * 100:+.1f} %), mean {statistics.fmean(diffs) * 1e3:+.2f} ms"
    )


def step_bands(diffs: Sequence[float], step: float) -> tuple[float, float, float, float]:
    """How the per-request differences ``diffs`` (client - replay, s) fall around their
    median in decode steps of ``step`` seconds: the shares within half a step of the
    median, a step below it, a step above it, and farther. A request joins the decode
    server's steps at one of their boundaries, served as simulated: when the two step
    grids are out of phase, a request's difference is the phase or the phase less a step,
    and the median lands on whichever band holds more than half."""
    if not diffs or step <= 0:
        return (0.0, 0.0, 0.0, 0.0)
    median = statistics.median(diffs)
    counts = [0, 0, 0, 0]
    for d in diffs:
        k = round((d - median) / step)
        counts[0 if k == 0 else 1 if k == -1 else 2 if k == 1 else 3] += 1
    n = len(diffs)
    return (counts[0] / n, counts[1] / n, counts[2] / n, counts[3] / n)


def steps_line(client: Sequence[float], replay: Sequence[Finished], output: int) -> str:
    """:func:`step_bands` of the TTFT's paired differences, in the replay's decode step
    (the median of its requests' time per output token after the first)."""
    if output < 2:
        return "decode steps: one output token, no decode step"
    step = statistics.median((f.finish_time - f.first_token_time) / (output - 1) for f in replay)
    diffs = [c - _ttft(f) for c, f in zip(client, replay, strict=True)]
    near, below, above, far = step_bands(diffs, step)
    return (
        f"TTFT paired differences by decode step ({step * 1e3:.2f} ms): {near * 100:.0f} % within "
        f"half a step of their median, {below * 100:.0f} % a step below, {above * 100:.0f} % a "
        f"step above, {far * 100:.0f} % farther"
    )


#: How many evenly spaced moves of the warm-up arrivals, over one decode step,
#: :func:`phase_line` replays.
PHASE_MOVES = 5


def shifted_arrivals(arrivals: Sequence[float], warm: int, shift: float) -> list[float]:
    """``arrivals`` with the first ``warm`` (the warm-up's, left out of every figure)
    ``shift`` seconds later."""
    return [at + shift if i < warm else at for i, at in enumerate(arrivals)]


def phase_line(args: argparse.Namespace, dep: Deployment, run: Run) -> str:
    """The TTFT p50's error against replays of the run whose warm-up arrivals (left out of
    the figures) come later by :data:`PHASE_MOVES` evenly spaced fractions of the replay's
    decode step: the replay's decode steps start later by as much while the measured
    requests arrive as before, so only the phase between the replay's steps and the
    served ones moves; the mean over the moves is the error with the phase averaged out."""
    pd = pd_deployment(dep, run.front, run.handoff)
    warm = args.streams
    client = statistics.median(s.ttft for s in run.sent[warm:])
    arrivals = [s.at for s in run.sent]
    replay = simulate_arrivals(pd, arrivals, args.prompt, args.output)
    if args.output < 2:
        return "TTFT p50 error with the warm-up arrivals moved: one output token, no decode step"
    step = statistics.median(
        (f.finish_time - f.first_token_time) / (args.output - 1) for f in replay
    )
    cells, errors = [], []
    for k in range(PHASE_MOVES):
        shift = step * k / PHASE_MOVES
        moved = simulate_arrivals(
            pd, shifted_arrivals(arrivals, warm, shift), args.prompt, args.output
        )
        p50 = statistics.median(_ttft(f) for f in moved[warm:])
        errors.append((client - p50) / p50 * 100)
        cells.append(f"+{shift * 1e3:.1f} ms {errors[-1]:+.1f} %")
    return (
        f"TTFT p50 error with the warm-up arrivals moved by fifths of a decode step "
        f"({step * 1e3:.2f} ms): "
        + ", ".join(cells)
        + f"; their mean {statistics.fmean(errors):+.1f} %"
    )


async def proxy_stats(url: str) -> dict[str, Any]:
    status, answer = await request_json(url, "GET", "/stats")
    if status != 200:
        raise RuntimeError(f"GET /stats: HTTP {status}")
    stats: dict[str, Any] = answer
    return stats


async def server_stats(url: str) -> dict[str, Any]:
    """A server's ``/control/stats`` entry for its one model."""
    status, answer = await request_json(url, "GET", "/control/stats")
    if status != 200:
        raise RuntimeError(f"GET /control/stats: HTTP {status}")
    model: dict[str, Any] = answer["models"][0]
    return model


#: The engines' own histograms read from ``/metrics`` (simulated engine time).
ENGINE_SERIES = ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds")


def engine_sums(url: str) -> dict[str, tuple[float, float]]:
    """Each of :data:`ENGINE_SERIES`' sum and count over a server's ``/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    out = {}
    for name in ENGINE_SERIES:
        sums = [0.0, 0.0]
        for line in text.splitlines():
            for i, suffix in enumerate(("_sum", "_count")):
                if line.startswith(name + suffix):
                    sums[i] += float(line.rsplit(" ", 1)[1])
        out[name] = (sums[0], sums[1])
    return out


def engine_mean(run: Run, server: str, series: str) -> float:
    """The mean (ms) of one of a server's :data:`ENGINE_SERIES` over the run."""
    before, after = run.sums[server][0][series], run.sums[server][1][series]
    count = after[1] - before[1]
    return (after[0] - before[0]) / count * 1e3 if count else 0.0


def lag_mean(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The mean pacing lag (ms) of the engine events between two ``/control/stats``."""
    b, a = before["pacing_lag_ms"], after["pacing_lag_ms"]
    events = a["events"] - b["events"]
    return (a["total"] - b["total"]) / events if events else 0.0


def stage_mean(before: dict[str, Any], after: dict[str, Any], stage: str) -> float:
    """A stage's mean (s) over the requests between two ``/stats`` answers."""
    b, a = before["stages"][stage], after["stages"][stage]
    count = a["count"] - b["count"]
    return (a["total_ms"] - b["total_ms"]) / count / 1e3 if count else 0.0


def calibrate(args: argparse.Namespace, dep: Deployment, url: str) -> tuple[float, float, float]:
    """Steps 0 and 1: the deployment's added latency per request (s) on one stream, and
    the proxy's front share of it. Returns (total, front, handoff)."""
    model = dep.model.name
    warm = 2 * args.streams
    trio.run(run_streams, url, model, args.streams, warm, args.prompt, args.output, 0)
    before = trio.run(proxy_stats, url)
    sent = trio.run(run_streams, url, model, 1, args.calibration, args.prompt, args.output, warm)
    after = trio.run(proxy_stats, url)
    bad = [s for s in sent if s.status != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} calibration requests failed (HTTP {bad[0].status})")
    sim = simulate_arrivals(
        pd_deployment(dep, 0.0, 0.0), [s.at for s in sent], args.prompt, args.output
    )
    added = statistics.fmean(
        s.ttft - (f.first_token_time - f.arrival_time) for s, f in zip(sent, sim, strict=True)
    )
    front = min(max(stage_mean(before, after, "front"), 0.0), max(added, 0.0))
    return added, front, max(0.0, added - front)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="Llama-3.3-70B-Instruct-FP8")
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--prompt", type=int, default=1000, help="prompt tokens (default 1000)")
    parser.add_argument("--output", type=int, default=200, help="output tokens (default 200)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--calibration", type=int, default=20)
    parser.add_argument(
        "--no-admission-probe",
        action="store_true",
        help="run the proxy without its admission probe (one round trip less per request)",
    )
    args = parser.parse_args()
    for name in ("prompt", "output", "streams", "requests", "calibration"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.requests <= args.streams:
        parser.error("--requests must be more than --streams")
    if args.prompt < 3:
        parser.error("--prompt must be at least 3 (a unique prompt)")
    return args


@attrs.frozen
class Run:
    """The measured run: what the client saw, the proxy's ``/stats`` around it, the hop
    calibrated before it, and the machine while it ran."""

    sent: list[Sent]
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]
    added: float
    front: float
    handoff: float
    wall: float
    cpu: dict[str, float]
    load: tuple[float, float]
    steal: float
    #: each server's ``/control/stats`` model entry before and after the run
    engines: dict[str, tuple[dict[str, Any], dict[str, Any]]]
    #: each server's :func:`engine_sums` before and after the run
    sums: dict[str, tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]]


def measure(args: argparse.Namespace, dep: Deployment, config: Path) -> Run:
    """Start the three processes, calibrate the hop (steps 0-1), then run step 2."""
    common = ["--config", str(config), "--hardware", args.hardware, "--port", "0"]
    load_before = os.getloadavg()[0]
    steal_before = machine_steal()
    with (
        ServerProcess(["--role", "prefill", *common]) as prefill,
        ServerProcess(["--role", "decode", *common]) as decode,
        ServerProcess(
            ["--prefill", prefill.url, "--decode", decode.url, "--port", "0"]
            + (["--no-admission-probe"] if args.no_admission_probe else []),
            command="proxy",
        ) as proxy,
    ):
        added, front, handoff = calibrate(args, dep, proxy.url)
        servers = {"prefill": prefill, "decode": decode, "proxy": proxy}
        pids = {name: server.proc.pid for name, server in servers.items() if server.proc}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        backends = {"prefill": prefill.url, "decode": decode.url}
        before = {name: trio.run(server_stats, url) for name, url in backends.items()}
        sums_before = {name: engine_sums(url) for name, url in backends.items()}
        stats_before = trio.run(proxy_stats, proxy.url)
        run_start = time.perf_counter()
        first = 2 * args.streams + args.calibration
        sent = trio.run(
            run_streams,
            proxy.url,
            dep.model.name,
            args.streams,
            args.requests,
            args.prompt,
            args.output,
            first,
        )
        wall = time.perf_counter() - run_start
        cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / wall for name, pid in pids.items()}
        stats_after = trio.run(proxy_stats, proxy.url)
        engines = {
            name: (before[name], trio.run(server_stats, url)) for name, url in backends.items()
        }
        sums = {name: (sums_before[name], engine_sums(url)) for name, url in backends.items()}
    load = (load_before, os.getloadavg()[0])
    steal = steal_pct(steal_before, machine_steal())
    return Run(
        sent,
        stats_before,
        stats_after,
        added,
        front,
        handoff,
        wall,
        cpu,
        load,
        steal,
        engines,
        sums,
    )


def stages_line(run: Run, replay: Sequence[Finished]) -> str:
    """Where the TTFT went, served (the proxy's stages over the run) and simulated (the
    replay's stages), means in ms over every request of the run (the first streams'
    included, unlike the table)."""
    served = {
        stage: stage_mean(run.stats_before, run.stats_after, stage) * 1e3
        for stage in ("front", "prefill", "handoff", "decode_head")
    }
    sim = {
        "arrival -> prefill end": statistics.fmean(
            f.prefill_end_time - f.arrival_time for f in replay
        ),
        "hand-off": statistics.fmean(f.transfer_end_time - f.prefill_end_time for f in replay),
        "first decode step": statistics.fmean(
            f.first_token_time - f.transfer_end_time for f in replay
        ),
    }
    return (
        "where TTFT goes (means over the run, ms): served "
        + ", ".join(f"{k} {v:.2f}" for k, v in served.items())
        + "; simulated "
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sim.items())
    )


def engines_line(run: Run, replay: Sequence[Finished]) -> str:
    """The engines' own times against the replay's (means over the run, ms): what the
    servers' simulated engines took, the rest of the client's TTFT being the HTTP between
    the processes and the lag."""
    prefill = engine_mean(run, "prefill", "vllm:e2e_request_latency_seconds")
    decode = engine_mean(run, "decode", "vllm:time_to_first_token_seconds")
    lags = ", ".join(f"{name} {lag_mean(*pair):.2f}" for name, pair in run.engines.items())
    sim_prefill = statistics.fmean(f.prefill_end_time - f.arrival_time for f in replay)
    sim_decode = statistics.fmean(f.first_token_time - f.prefill_end_time for f in replay)
    return (
        f"engines' own time (ms): prefill server arrival -> answer {prefill:.2f}, decode "
        f"server arrival -> first token {decode:.2f}; replay: arrival -> prefill end "
        f"{sim_prefill * 1e3:.2f} (frontend included), prefill end -> first token "
        f"{sim_decode * 1e3:.2f} (hand-off included); pacing lag mean: {lags}"
    )


def loaded_front_line(args: argparse.Namespace, dep: Deployment, run: Run) -> str:
    """The replay again with the proxy's front stage as the run measured it (at
    ``--streams`` streams, not on one) as the frontend latency: how much of the TTFT's
    difference the hop's growth under load accounts for."""
    front = stage_mean(run.stats_before, run.stats_after, "front")
    pd = pd_deployment(dep, front, run.handoff)
    warm = args.streams
    replay = simulate_arrivals(pd, [s.at for s in run.sent], args.prompt, args.output)[warm:]
    sent = run.sent[warm:]
    cells = []
    for name, client, sim in (
        ("TTFT", [s.ttft for s in sent], [_ttft(f) for f in replay]),
        ("E2E", [s.e2e for s in sent], [_e2e(f) for f in replay]),
    ):
        c_mean, c_p50 = _ms(client)
        s_mean, s_p50 = _ms(sim)
        cells.append(
            f"{name} mean {s_mean:.1f} ({(c_mean - s_mean) / s_mean * 100:+.1f}%), p50 "
            f"{s_p50:.1f} ({(c_p50 - s_p50) / s_p50 * 100:+.1f}%)"
        )
    return (
        f"replay with the run's own front stage ({front * 1e3:.2f} ms) as the frontend "
        "latency: " + "; ".join(cells)
    )


def _ttft(f: Finished) -> float:
    return f.first_token_time - f.arrival_time


def _e2e(f: Finished) -> float:
    return f.finish_time - f.arrival_time


def report(args: argparse.Namespace, dep: Deployment, run: Run) -> None:
    """Simulate the run's traffic and print the comparison."""
    pd = pd_deployment(dep, run.front, run.handoff)
    warm = args.streams
    whole = simulate_arrivals(pd, [s.at for s in run.sent], args.prompt, args.output)
    replay = whole[warm:]
    loop = simulate_closed_loop(pd, args.streams, args.requests, args.prompt, args.output)
    loop = sorted(loop, key=lambda f: f.request_id)[warm:]
    sent = run.sent[warm:]
    print(
        f"{dep.model.name} on {dep.hardware_name}: 1P1D behind the proxy, {args.streams} "
        f"streams, {args.requests} requests of {args.prompt} -> {args.output} tokens "
        f"(the first {warm} left out)"
    )
    print(
        f"hop (one stream, {args.calibration} requests): {run.added * 1e3:.2f} ms added per "
        f"request: frontend {run.front * 1e3:.2f} ms, hand-off {run.handoff * 1e3:.2f} ms"
    )
    # (the servers' figures cover every request of the run: so do the replay's here)
    print(stages_line(run, whole))
    print(engines_line(run, whole))
    print(loaded_front_line(args, dep, run))
    print(
        f"{'ms':<10} {'client':>9} {'':>9} | {'sim (same arrivals)':^37} | "
        f"{'sim (closed loop)':^37}"
    )
    print(
        f"{'':<10} {'mean':>9} {'p50':>9} | "
        + " | ".join(f"{'mean':>9} {'p50':>9} {'err mean':>8} {'err p50':>8}" for _ in range(2))
    )
    for name, client, pick in (
        ("TTFT", [s.ttft for s in sent], _ttft),
        ("E2E", [s.e2e for s in sent], _e2e),
    ):
        print(_row(name, client, [[pick(f) for f in replay], [pick(f) for f in loop]]))
    for name, client, pick in (
        ("TTFT", [s.ttft for s in sent], _ttft),
        ("E2E", [s.e2e for s in sent], _e2e),
    ):
        print(paired_line(name, client, [pick(f) for f in replay]))
    print(steps_line([s.ttft for s in sent], replay, args.output))
    print(phase_line(args, dep, run))
    busy = ", ".join(f"{name} {share * 100:.0f} %" for name, share in run.cpu.items())
    print(
        f"run {run.wall:.1f} s; CPU of a core: {busy}; load average {run.load[0]:.2f} "
        f"before, {run.load[1]:.2f} after; steal {run.steal:.1f} %"
    )


def main() -> int:
    args = parse_args()
    try:
        config = resolve_shipped(args.config, "config", "--config")
        dep = load_deployment(config, args.hardware)
        pd_deployment(dep, 0.0, 0.0)  # (a deployment that cannot be split says so now)
    except ConfigError as exc:
        print(f"bench_pd_serve: {exc}", file=sys.stderr)
        return 1
    run = measure(args, dep, config)
    failed = [s for s in run.sent if s.status != 200]
    if failed:
        print(
            f"bench_pd_serve: {len(failed)} requests failed (HTTP {failed[0].status})",
            file=sys.stderr,
        )
        return 1
    report(args, dep, run)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
