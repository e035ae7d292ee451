"""KV tiers behind HBM on the long agent loops of docs/kv-tiers.md: HBM only, HBM + host
DRAM, HBM + host DRAM + NVMe.

Llama-3.3-70B-Instruct-FP8 on one H200 (tp 1) runs ``configs/workloads/agent-long-
context.toml`` (64 agents, 16 turns of ~1,200 new tokens, a shared 4k system prompt, 20 s
between turns: ~1.2 M tokens of live context against ~0.4 M of HBM). For each layout it
prints the prompt tokens found in each tier (as fractions of the tokens the prefix cache
was asked for), TTFT p50/p99, output throughput, the fetches made and the tokens
recomputed because computing them was cheaper than fetching them, and the simulator's
wall time. With ``--figure`` it also writes ``docs/kv_tiers.png``.

    python scripts/bench_tiers.py [--host GIB] [--disk GIB] [--requests N] [--figure]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import attrs

from inference_lab.core.config import Deployment, load_deployment, load_workload
from inference_lab.sim.run import SimResult, run_simulation

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "fidelity" / "Llama-3.3-70B-Instruct-FP8.toml"
WORKLOAD = ROOT / "configs" / "workloads" / "agent-long-context.toml"


def _with_tiers(dep: Deployment, host: float, disk: float) -> Deployment:
    sched = attrs.evolve(dep.scheduler, kv_offloading_size=host, kv_offloading_disk_size=disk)
    return attrs.evolve(dep, scheduler=sched)


def _row(name: str, result: SimResult, wall: float) -> dict[str, object]:
    s = result.summary
    pc = result.prefix_cache
    asked = pc.query_tokens if pc is not None else 0
    hbm = (pc.hit_tokens / asked if asked else 0.0) if pc is not None else 0.0
    t = result.tiers
    if t is not None:
        hbm = t.hbm_hit_rate
    return {
        "layout": name,
        "hbm": hbm,
        "host": t.host_hit_rate if t is not None else 0.0,
        "disk": t.disk_hit_rate if t is not None else 0.0,
        "ttft_p50": (s.ttft.p50 or 0.0) / 1e3,
        "ttft_p99": (s.ttft.p99 or 0.0) / 1e3,
        "out_tok_s": s.output_tokens_per_s,
        "fetches": t.fetches if t is not None else 0,
        "recomputed": t.recomputed_tokens if t is not None else 0,
        "wall": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", type=float, default=192.0, help="host tier, GiB per GPU")
    parser.add_argument("--disk", type=float, default=1024.0, help="NVMe tier, GiB per GPU")
    parser.add_argument("--requests", type=int, default=None, help="fewer turns, quicker")
    parser.add_argument("--figure", action="store_true", help="write docs/kv_tiers.png")
    args = parser.parse_args()
    base = load_deployment(CONFIG, "h200")
    workload = load_workload(WORKLOAD)
    if args.requests is not None:
        workload = attrs.evolve(workload, num_requests=args.requests)
    layouts = (
        ("HBM only", base),
        (f"+ DRAM {args.host:g} GiB", _with_tiers(base, args.host, 0.0)),
        (f"+ DRAM + NVMe {args.disk:g} GiB", _with_tiers(base, args.host, args.disk)),
    )
    rows = []
    for name, dep in layouts:
        start = time.perf_counter()
        result = run_simulation(dep, workload)
        rows.append(_row(name, result, time.perf_counter() - start))
    print(f"{CONFIG.stem} on H200, {WORKLOAD.stem}, {workload.num_requests} turns")
    print(
        f"{'layout':24} {'HBM':>6} {'host':>6} {'disk':>6} {'TTFT p50':>9} {'p99':>7}"
        f" {'out tok/s':>9} {'fetches':>8} {'recomputed':>10} {'wall s':>7}"
    )
    for r in rows:
        print(
            f"{r['layout']:24} {r['hbm']:6.1%} {r['host']:6.1%} {r['disk']:6.1%}"
            f" {r['ttft_p50']:8.2f}s {r['ttft_p99']:6.1f}s {r['out_tok_s']:9.0f}"
            f" {r['fetches']:8,} {r['recomputed']:10,} {r['wall']:7.1f}"
        )
    if args.figure:
        _figure(rows, ROOT / "docs" / "kv_tiers.png")
    return 0


def _figure(rows: list[dict[str, object]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 3.2))
    names = [str(r["layout"]) for r in rows]
    bottom = [0.0] * len(rows)
    for key, colour in (("hbm", "#1f77b4"), ("host", "#ff7f0e"), ("disk", "#2ca02c")):
        values = [float(r[key]) * 100 for r in rows]  # type: ignore[arg-type]
        left.bar(names, values, bottom=bottom, color=colour, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set_ylabel("prompt tokens found (%)")
    left.set_ylim(0, 100)
    left.legend(fontsize=8)
    left.tick_params(axis="x", labelsize=7)
    x = range(len(rows))
    right.bar([i - 0.2 for i in x], [float(r["ttft_p50"]) for r in rows], 0.4, label="p50")  # type: ignore[arg-type]
    right.bar([i + 0.2 for i in x], [float(r["ttft_p99"]) for r in rows], 0.4, label="p99")  # type: ignore[arg-type]
    right.set_xticks(list(x), names, fontsize=7)
    right.set_ylabel("TTFT (s)")
    right.legend(fontsize=8)
    fig.suptitle("Llama-3.3-70B FP8 on one H200, 64 agents x 16 turns, 20 s think time", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
