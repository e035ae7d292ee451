"""Benchmark data-parallel ranks (``serve --data-parallel-size``) behind HAProxy with wrk.

Three runs of the same closed loop -- wrk's ``scripts/wrk_stream.lua`` (a 200-byte prompt
= 50 prompt tokens, 200 output tokens run to the end, streamed) on ``ranks x streams``
connections, each after a warm-up run of the same command:

1. ``ranks`` rank processes of gpt-oss-20b on b200 behind HAProxy ``balance leastconn``
   (health checks on ``/health``): wrk's E2E p50 against the roofline's for ``streams``
   clients on one engine (``benchkit.predict_closed_loop``). Target: within 3 %.
2. The same behind ``balance roundrobin``, against ``inference-lab sim --replicas ranks``
   (round robin) on the same closed loop: the two must agree within the serve fidelity
   targets (docs/fidelity.md).
3. The whole load on one process (no ranks, no HAProxy), against the roofline's for
   ``ranks x streams`` clients on one engine: what one process does with it.

It prints a table and the machine's load (1-minute load average before and after, the
hypervisor's steal): other work on the machine shows up in the figures.

    python scripts/bench_ranks.py                       # 2 ranks x 128 streams, 15 s
    python scripts/bench_ranks.py --ranks 2 --streams 128 --duration 15

Needs Debian's ``haproxy`` and ``wrk`` on the PATH (``apt-get install haproxy wrk``).
Only 127.0.0.1 is contacted; every process started is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit import PROMPT_BYTES, machine_steal, predict_closed_loop, steal_pct

from inference_lab.core.config import load_deployment
from inference_lab.resources import shipped_dir

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "scripts" / "wrk_stream.lua"
MODEL = "gpt-oss-20b"
OUTPUT = 200
PROMPT = PROMPT_BYTES // 4
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}

HAPROXY_CFG = """\
global
    maxconn 8192
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
    default-server inter 1s fall 2 rise 2
{servers}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """``inference-lab serve`` (with ``--data-parallel-size``) until stopped: its URLs."""

    def __init__(self, ranks: int) -> None:
        cmd = [sys.executable, "-m", "inference_lab.cli", "serve", "--config", MODEL]
        cmd += ["--port", "0", "--data-parallel-size", str(ranks), "--run-to-max-tokens"]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        banner = ""
        for line in self.proc.stdout:
            banner += line
            if line.startswith("listening on "):
                self.urls = re.findall(r"http://\S+", line)
                break
        else:
            raise SystemExit("bench_ranks: the server did not start")
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", banner)]
        self.pids = pids or [self.proc.pid]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class HAProxy:
    def __init__(self, urls: list[str], balance: str) -> None:
        self.port = free_port()
        servers = "\n".join(
            f"    server rank{r} {u.removeprefix('http://')} check" for r, u in enumerate(urls)
        )
        self.dir = tempfile.TemporaryDirectory()
        cfg = Path(self.dir.name) / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(front=self.port, balance=balance, servers=servers))
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stderr=subprocess.DEVNULL)
        time.sleep(3)  # two health checks: every rank UP

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.dir.cleanup()


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, connections: int, duration: float, watch: list[int]) -> dict[str, float]:
    """wrk's E2E percentiles (seconds) and requests/s for one run (after a warm-up run),
    and the cores the processes ``watch`` (the servers, HAProxy) and wrk used meanwhile."""
    threads = min(2, connections)
    base = ["wrk", f"-t{threads}", f"-c{connections}", "--latency", "-s", str(LUA)]
    target = url + "/v1/completions"
    env = {**os.environ, "WRK_MAX_TOKENS": str(OUTPUT), "WRK_MODEL": MODEL}
    subprocess.run([*base, "-d3s", target], capture_output=True, env=env, check=True)
    before = [cpu_seconds(p) for p in watch]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(
        [*base, f"-d{duration:g}s", target], capture_output=True, text=True, env=env, check=True
    )
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = [cpu_seconds(p) - b for p, b in zip(watch, before, strict=True)]
    wrk_cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    out = done.stdout
    result = {f"cores_{i}": u / wall for i, u in enumerate(used)}
    result["wrk_cores"] = wrk_cpu / wall
    for pct in ("50", "90", "99"):
        match = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
        assert match, out
        result[f"p{pct}"] = float(match.group(1)) * _UNITS[match.group(2)]
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert rps, out
    result["rps"] = float(rps.group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    result["non_2xx"] = float(errors.group(1)) if errors else 0.0
    return result


def sim_p50(ranks: int, streams: int, duration: float) -> dict[str, float]:
    """``inference-lab sim --replicas ranks`` on the same closed loop (round robin)."""
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "loop.toml"
        users = ranks * streams
        requests = users * max(4, int(duration * 3))
        workload.write_text(
            f'arrival_pattern = "closed_loop"\nnum_concurrent_users = {users}\n'
            f"closed_loop_jitter_secs = 0.0\nnum_requests = {requests}\n"
            f'input_len_dist = {{ type = "fixed", value = {PROMPT} }}\n'
            f'output_len_dist = {{ type = "fixed", value = {OUTPUT} }}\nseed = 1\n'
        )
        out = Path(tmp) / "sim.json"
        cmd = [sys.executable, "-m", "inference_lab.cli", "sim", "--config", MODEL]
        cmd += ["--workload", str(workload), "--replicas", str(ranks), "-o", str(out), "-q"]
        subprocess.run([*cmd, "--no-progress"], check=True, capture_output=True, cwd=ROOT)
        summary: dict[str, Any] = json.loads(out.read_text())
    e2e = summary["latency_ms"]["e2e"]
    return {"p50": e2e["p50"] / 1e3, "rps": summary["throughput"]["requests_per_s"]}


def row(label: str, measured: dict[str, float], reference: float, ref_label: str) -> str:
    err = (measured["p50"] / reference - 1) * 100
    return (
        f"| {label} | {measured['p50'] * 1e3:.1f} ms | {measured.get('p99', float('nan')) * 1e3:.1f}"
        f" ms | {ref_label} {reference * 1e3:.1f} ms | {err:+.2f} % | {measured['rps']:.1f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--streams", type=int, default=128, help="closed-loop streams per rank")
    parser.add_argument("--duration", type=float, default=15.0)
    args = parser.parse_args()
    for tool in ("haproxy", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench_ranks: {tool} is not installed (apt-get install {tool})")
    dep = load_deployment(shipped_dir("configs") / f"{MODEL}.toml", "b200")
    seqs = dep.scheduler.max_num_seqs
    per_rank = predict_closed_loop(
        dep, clients=args.streams, seqs=seqs, prompt=PROMPT, output=OUTPUT
    )
    total = args.ranks * args.streams
    one = predict_closed_loop(dep, clients=total, seqs=seqs, prompt=PROMPT, output=OUTPUT)
    load_before, steal_before = os.getloadavg()[0], machine_steal()
    rows = []
    fleet = Serve(args.ranks)
    try:
        for balance in ("leastconn", "roundrobin"):
            proxy = HAProxy(fleet.urls, balance)
            try:
                url = f"http://127.0.0.1:{proxy.port}"
                rows.append(
                    (balance, wrk(url, total, args.duration, [*fleet.pids, proxy.proc.pid]))
                )
            finally:
                proxy.stop()
    finally:
        fleet.stop()
    single = Serve(1)
    try:
        alone = wrk(single.urls[0], total, args.duration, single.pids)
    finally:
        single.stop()
    sim = sim_p50(args.ranks, args.streams, args.duration)
    load_after, steal_after = os.getloadavg()[0], machine_steal()
    print(
        f"{args.ranks} ranks x {args.streams} streams ({total} wrk connections), {args.duration:g} s"
    )
    print("| run | wrk p50 | wrk p99 | against | error | requests/s |")
    print("|---|---|---|---|---|---|")
    leastconn, roundrobin = rows[0][1], rows[1][1]
    print(row(f"{args.ranks} ranks, HAProxy leastconn", leastconn, per_rank["e2e"], "roofline"))
    print(row(f"{args.ranks} ranks, HAProxy roundrobin", roundrobin, sim["p50"], "sim --replicas"))
    print(row(f"1 process, {total} streams", alone, one["e2e"], "roofline"))
    print(
        f"sim --replicas {args.ranks}: p50 {sim['p50'] * 1e3:.1f} ms, {sim['rps']:.1f} requests/s"
    )
    print(f"non-2xx: {[r['non_2xx'] for _, r in rows] + [alone['non_2xx']]}")
    for label, r in [*rows, ("one process", alone)]:
        cores = [r[k] for k in sorted(r) if k.startswith("cores_")]
        print(
            f"cores used, {label}: servers / HAProxy {', '.join(f'{c:.2f}' for c in cores)}; "
            f"wrk {r['wrk_cores']:.2f}"
        )
    print(
        f"load average {load_before:.2f} -> {load_after:.2f}, steal "
        f"{steal_pct(steal_before, steal_after):.1f} %"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
