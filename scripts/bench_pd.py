"""Aggregated against prefill/decode splits at the same GPU count, in the simulator.

Llama-3.3-70B-Instruct-FP8 on H200 (``configs/fidelity/``, tp 1 per replica): two
aggregated replicas against 1P1D (2 GPUs), three aggregated replicas against 2P1D and 1P2D
(3 GPUs), at input 4,000 / output 500 and input 1,000 / output 1,000 tokens, open loop
(Poisson) at several rates for ``--duration`` simulated seconds of arrivals each. For
every layout and rate: TTFT and TPOT p50 / p99 and the goodput under the SLO (TTFT <=
``--ttft-ms`` and TPOT <= ``--tpot-ms`` per request, the rate times the share of requests
meeting both, as ``plan`` counts it); for every layout, the highest rate whose p99s meet
the SLO and where its TTFT goes there (a split's four stages, ``sim``'s). Prints markdown
tables and writes the figure (``--out``, default ``docs/pd_bench.png``). Simulated
figures: the same on any machine.

    python scripts/bench_pd.py [--duration S] [--ttft-ms MS] [--tpot-ms MS] [--jobs N]
                               [--out PATH]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import attrs
import numpy as np

from inference_lab.cli_args import CliParser, integer, number
from inference_lab.core.config import (
    Deployment,
    FixedDist,
    Workload,
    load_deployment,
    split_pd,
    vary_deployment,
)
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir
from inference_lab.sim.run import run_simulation
from inference_lab.sim.summary import request_latencies

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "fidelity/Llama-3.3-70B-Instruct-FP8.toml"
HARDWARE = "h200"
#: (name, GPUs, prefill replicas, decode replicas); 0 prefill: aggregated replicas.
LAYOUTS = (
    ("2 aggregated", 2, 0, 2),
    ("1P1D", 2, 1, 1),
    ("3 aggregated", 3, 0, 3),
    ("2P1D", 3, 2, 1),
    ("1P2D", 3, 1, 2),
)
#: (name, input tokens, output tokens, offered rates in requests/s)
WORKLOADS = (
    ("input 4k / output 500", 4000, 500, tuple(r / 2 for r in range(1, 15))),
    ("input 1k / output 1k", 1000, 1000, tuple(float(r) for r in range(2, 21, 2))),
)
STAGES = ("queue", "prefill", "hand-off", "first decode")


@attrs.frozen(kw_only=True)
class Point:
    """One layout at one rate: the figures the tables and the figure print."""

    workload: str
    layout: str
    rate: float
    requests: int
    ttft_p50: float  # ms
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    goodput: float  # requests/s meeting both bounds
    meets: bool  # both p99s within their bounds
    stages: tuple[float, ...]  # mean TTFT by stage (ms): a split's four, else queue and rest


def _deployment(base: Deployment, prefill: int, decode: int) -> Deployment:
    if prefill == 0:
        return vary_deployment(base, replicas=decode)
    return split_pd(base, prefill, decode)


def _run(task: tuple[str, str, int, int, int, int, float, float, float, float]) -> Point:
    """One simulation (a process-pool task): the layout at the rate, reduced to a Point."""
    workload, layout, prefill, decode, inp, out, rate, duration, ttft_ms, tpot_ms = task
    base = load_deployment(shipped_dir("configs") / CONFIG, HARDWARE)
    count = max(200, math.ceil(rate * duration))
    load = Workload(
        arrival_pattern="poisson",
        arrival_rate=rate,
        num_requests=count,
        input_len_dist=FixedDist(value=inp),
        output_len_dist=FixedDist(value=out),
        seed=7,
    )
    result = run_simulation(_deployment(base, prefill, decode), load)
    lat = request_latencies(result.finished)
    ttft, tpot = lat.ttft * 1e3, lat.tpot * 1e3
    good = (ttft <= ttft_ms) & ~(tpot > tpot_ms)
    pd = result.disaggregation
    if pd is not None:
        parts = (pd.ttft_queue, pd.ttft_prefill, pd.ttft_handoff, pd.ttft_first_decode)
        stages = tuple(s.mean or 0.0 for s in parts)
    else:
        queue = float(np.mean(lat.queue)) * 1e3
        stages = (queue, float(np.mean(ttft)) - queue)
    p99 = (float(np.percentile(ttft, 99)), float(np.nanpercentile(tpot, 99)))
    return Point(
        workload=workload,
        layout=layout,
        rate=rate,
        requests=count,
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p99=p99[0],
        tpot_p50=float(np.nanpercentile(tpot, 50)),
        tpot_p99=p99[1],
        goodput=rate * int(good.sum()) / count,
        meets=p99[0] <= ttft_ms and p99[1] <= tpot_ms and result.summary.requests_refused == 0,
        stages=stages,
    )


def _tables(points: Sequence[Point], ttft_ms: float, tpot_ms: float) -> None:
    for name, _, _, _ in WORKLOADS:
        print(f"\n### {name}: every rate (TTFT and TPOT in ms; goodput in req/s)\n")
        print(
            "| layout | GPUs | rate | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | goodput | SLO |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for layout, gpus, _, _ in LAYOUTS:
            for p in (p for p in points if p.workload == name and p.layout == layout):
                print(
                    f"| {layout} | {gpus} | {p.rate:g} | {p.ttft_p50:,.0f} | {p.ttft_p99:,.0f} "
                    f"| {p.tpot_p50:.1f} | {p.tpot_p99:.1f} | {p.goodput:.2f} "
                    f"| {'met' if p.meets else '-'} |"
                )
    for name, _, _, _ in WORKLOADS:
        print(
            f"\n### {name}: the highest rate meeting TTFT p99 <= {ttft_ms:g} ms and TPOT p99 <= "
            f"{tpot_ms:g} ms, and where TTFT goes there (mean ms)\n"
        )
        print(
            "| layout | GPUs | max rate | per GPU | goodput | TTFT p99 | TPOT p99 | TTFT stages |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for layout, gpus, prefill, _ in LAYOUTS:
            ok = [p for p in points if p.workload == name and p.layout == layout and p.meets]
            if not ok:
                print(f"| {layout} | {gpus} | none | - | - | - | - | - |")
                continue
            best = max(ok, key=lambda p: p.rate)
            names = STAGES if prefill else ("queue", "prefill and first token")
            stages = " + ".join(f"{v:,.0f} {n}" for n, v in zip(names, best.stages, strict=True))
            print(
                f"| {layout} | {gpus} | {best.rate:g} | {best.rate / gpus:.2f} | "
                f"{best.goodput:.2f} | {best.ttft_p99:,.0f} | {best.tpot_p99:.1f} | {stages} |"
            )


#: colour, line, marker: 2-GPU layouts dashed; a split whose bottleneck pool is another
#: layout's (1P1D and 1P2D share a prefill pool) draws over it, so the markers differ
_STYLE = {
    "2 aggregated": ("#7f7f7f", "--", "o"),
    "1P1D": ("#1f77b4", "--", "s"),
    "3 aggregated": ("#000000", "-", "o"),
    "2P1D": ("#ff7f0e", "-", "^"),
    "1P2D": ("#2ca02c", "-", "v"),
}


def _figure(path: Path, points: Sequence[Point], ttft_ms: float, tpot_ms: float) -> None:
    """Per workload (a row): TTFT p50 / p99, TPOT p50 / p99 and goodput against the offered
    rate, a line per layout (2-GPU layouts dashed), the SLO's bounds in red."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 7.5), layout="constrained")
    axes = fig.subplots(len(WORKLOADS), 3)
    for row, (name, _, _, _) in zip(axes, WORKLOADS, strict=True):
        for layout, gpus, _, _ in LAYOUTS:
            pts = [p for p in points if p.workload == name and p.layout == layout]
            rates = [p.rate for p in pts]
            colour, dash, marker = _STYLE[layout]
            style = {"color": colour, "marker": marker, "ms": 4, "alpha": 0.85}
            label = f"{layout} ({gpus} GPUs)"
            row[0].plot(rates, [p.ttft_p99 for p in pts], dash, label=label, **style)
            row[0].plot(rates, [p.ttft_p50 for p in pts], ":", color=colour, lw=1)
            row[1].plot(rates, [p.tpot_p99 for p in pts], dash, label=label, **style)
            row[1].plot(rates, [p.tpot_p50 for p in pts], ":", color=colour, lw=1)
            row[2].plot(rates, [p.goodput for p in pts], dash, label=label, **style)
        row[0].axhline(ttft_ms, color="tab:red", lw=0.8)
        row[0].set_yscale("log")
        row[0].set_ylabel(f"{name}\nTTFT (ms): p99 line, p50 dotted")
        row[1].axhline(tpot_ms, color="tab:red", lw=0.8)
        row[1].set_ylabel("TPOT (ms): p99 line, p50 dotted")
        row[2].set_ylabel(f"goodput (req/s within {ttft_ms:g} / {tpot_ms:g} ms)")
        for ax in row:
            ax.set_xlabel("offered rate (requests/s)")
            ax.grid(True, alpha=0.3)
    axes[0][2].legend(fontsize="small")
    fig.suptitle(
        "Llama-3.3-70B-Instruct-FP8 on H200 (tp 1 per replica): aggregated against P/D splits "
        "of the same GPUs",
        fontsize="medium",
    )
    fig.savefig(path, format="png", dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = CliParser(prog="bench_pd", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=number(gt=0), default=120.0)
    parser.add_argument("--ttft-ms", type=number(gt=0), default=2000.0)
    parser.add_argument("--tpot-ms", type=number(gt=0), default=50.0)
    parser.add_argument("--jobs", type=integer(ge=1), default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "pd_bench.png")
    args = parser.parse_args(argv)
    if not args.out.parent.is_dir():
        print(f"bench_pd: --out: no such directory: {args.out.parent}", file=sys.stderr)
        return 1
    try:
        load_deployment(shipped_dir("configs") / CONFIG, HARDWARE)
    except ConfigError as exc:
        print(f"bench_pd: {exc}", file=sys.stderr)
        return 1
    tasks = [
        (wname, layout, prefill, decode, inp, out, rate, args.duration, args.ttft_ms, args.tpot_ms)
        for wname, inp, out, rates in WORKLOADS
        for layout, _, prefill, decode in LAYOUTS
        for rate in rates
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        points = list(pool.map(_run, tasks))
    print(
        f"Llama-3.3-70B-Instruct-FP8 on {HARDWARE} (tp 1), Poisson arrivals for "
        f"{args.duration:g} s (at least 200 requests), seed 7; SLO: TTFT <= {args.ttft_ms:g} ms "
        f"and TPOT <= {args.tpot_ms:g} ms"
    )
    _tables(points, args.ttft_ms, args.tpot_ms)
    _figure(args.out, points, args.ttft_ms, args.tpot_ms)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
