"""Prefix caching in the simulator: what the cache is worth, and what the routers make of it.

Prints four markdown tables (simulated figures; only the last table's speed depends on the
machine):

1. the multi-turn chat workload (``configs/workloads/chat-sessions-200.toml``: 200
   sessions x 8 turns, a shared 2,048-token system prompt) at each session rate of
   ``--rates``, on gpt-oss-20b / b200 and Llama-3.1-8B-Instruct / h100, prefix caching
   on and off: TTFT p50 / p99 (all turns; first and last turn), throughput, hit rate;
2. the agent loop (``agent-loop-32.toml``: a closed loop of 32 agents) on and off, where
   the throughput is what the latency allows;
3. ``--replicas`` replicas of each deployment under every router on the chat workload at
   the last rate: hit rate, TTFT, requests per replica;
4. the simulator's speed on the two session workloads: simulated requests per CPU second.

    python scripts/bench_prefix.py [--rates 2,20] [--replicas 4] [--sessions N]
"""

from __future__ import annotations

import sys
import time

import attrs

from inference_lab.cli_args import CliParser, integer
from inference_lab.core.config import Deployment, Workload, load_deployment, load_workload
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir
from inference_lab.sim.run import SimResult, run_simulation

DEPLOYMENTS = (("gpt-oss-20b.toml", "b200"), ("Llama-3.1-8B-Instruct.toml", "h100"))
ROUTERS = ("round_robin", "least_loaded", "prefix_affinity", "kv_aware")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"bench_prefix: --rates: not a list of numbers: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit("bench_prefix: --rates: each rate must be a number > 0")
    return rates


def caching(dep: Deployment, on: bool) -> Deployment:
    return attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, enable_prefix_caching=on))


def timed(dep: Deployment, wl: Workload) -> tuple[SimResult, float]:
    cpu = time.process_time()
    result = run_simulation(dep, wl)
    return result, time.process_time() - cpu


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _hit(result: SimResult) -> str:
    pc = result.prefix_cache
    return "-" if pc is None or not pc.enabled else f"{pc.hit_rate:.1%}"


def _turns(result: SimResult) -> str:
    if result.sessions is None or not result.sessions.by_turn:
        return "-"
    turns = result.sessions.by_turn
    return f"{_ms(turns[0].ttft.p50)} / {_ms(turns[-1].ttft.p50)}"


def main() -> int:
    parser = CliParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,20", help="session starts per second (default 2,20)")
    parser.add_argument("--replicas", type=integer(ge=2), default=4)
    parser.add_argument(
        "--sessions", type=integer(ge=1), help="sessions of the chat workload (default 200)"
    )
    args = parser.parse_args()
    rates = _rates(args.rates)
    configs = shipped_dir("configs")
    try:
        chat = load_workload(configs / "workloads" / "chat-sessions-200.toml")
        agent = load_workload(configs / "workloads" / "agent-loop-32.toml")
        deps = [load_deployment(configs / name, hw) for name, hw in DEPLOYMENTS]
    except ConfigError as exc:
        print(f"bench_prefix: {exc}", file=sys.stderr)
        return 2
    if args.sessions is not None:
        assert chat.sessions is not None
        sessions = attrs.evolve(chat.sessions, num_sessions=args.sessions)
        chat = attrs.evolve(chat, sessions=sessions, num_requests=None)
    speed: list[tuple[str, int, float]] = []

    print("## Multi-turn chat: prefix caching on and off\n")
    print(
        "| deployment | sessions/s | cache | TTFT p50 | TTFT p99 | TTFT p50 turn 1 / 8 "
        "| output tok/s | req/s | hit rate |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for dep in deps:
        for rate in rates:
            wl = attrs.evolve(chat, arrival_rate=rate)
            for on in (True, False):
                r, cpu = timed(caching(dep, on), wl)
                s = r.summary
                speed.append(
                    (
                        f"{wl_name(dep)} chat, {rate:g}/s, {'on' if on else 'off'}",
                        s.requests_completed,
                        cpu,
                    )
                )
                print(
                    f"| {wl_name(dep)} | {rate:g} | {'on' if on else 'off'} | {_ms(s.ttft.p50)} "
                    f"| {_ms(s.ttft.p99)} | {_turns(r)} | {s.output_tokens_per_s:,.0f} "
                    f"| {s.requests_per_s:,.2f} | {_hit(r)} |",
                    flush=True,
                )

    print("\n## Agent loop (closed loop of 32): prefix caching on and off\n")
    print("| deployment | cache | TTFT p50 | TTFT p99 | req/s | output tok/s | span | hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for dep in deps:
        for on in (True, False):
            r, cpu = timed(caching(dep, on), agent)
            s = r.summary
            speed.append(
                (f"{wl_name(dep)} agent loop, {'on' if on else 'off'}", s.requests_completed, cpu)
            )
            print(
                f"| {wl_name(dep)} | {'on' if on else 'off'} | {_ms(s.ttft.p50)} "
                f"| {_ms(s.ttft.p99)} | {s.requests_per_s:,.2f} | {s.output_tokens_per_s:,.0f} "
                f"| {s.span_s:,.1f} s | {_hit(r)} |",
                flush=True,
            )

    rate = rates[-1]
    print(f"\n## {args.replicas} replicas, chat at {rate:g} sessions/s: the routers\n")
    print("| deployment | router | hit rate | TTFT p50 | TTFT p99 | requests per replica |")
    print("|---|---|---|---|---|---|")
    for dep in deps:
        for router in ROUTERS:
            hw = attrs.evolve(dep.hardware, replicas=args.replicas, router=router)
            r, cpu = timed(attrs.evolve(dep, hardware=hw), attrs.evolve(chat, arrival_rate=rate))
            s = r.summary
            per = " / ".join(str(x.requests) for x in r.replicas)
            print(
                f"| {wl_name(dep)} x {args.replicas} | {router} | {_hit(r)} | {_ms(s.ttft.p50)} "
                f"| {_ms(s.ttft.p99)} | {per} |",
                flush=True,
            )

    print("\n## Simulation speed (simulated requests per CPU second)\n")
    print("| run | requests | CPU s | requests / CPU s |")
    print("|---|---|---|---|")
    for name, requests, cpu in speed:
        print(f"| {name} | {requests:,} | {cpu:.2f} | {requests / cpu:,.0f} |")
    return 0


def wl_name(dep: Deployment) -> str:
    return f"{dep.model.name} / {dep.hardware_name}"


if __name__ == "__main__":
    sys.exit(main())
