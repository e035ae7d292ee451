"""Where TTFT goes in a disaggregated deployment: the figure of docs/disaggregation.md.

Llama-3.3-70B-Instruct-FP8 on H200 (tp 1 per replica), 4,000-token prompts and 500-token
answers, Poisson arrivals at ``--rate`` requests/s (default 2.5), 600 requests: the mean of
TTFT's four stages (prefill queue, prefill, hand-off, first decode step) for 1P1D, 2P1D and
1P2D, and the aggregated TTFT of the same GPU count beside each. Prints the table and writes
``docs/disaggregation_ttft.png``.

    python scripts/pd_ttft_figure.py [--rate R] [--out PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs

from inference_lab.core.config import Workload, load_deployment, split_pd
from inference_lab.core.config.workload import FixedDist
from inference_lab.sim.run import run_simulation

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "fidelity" / "Llama-3.3-70B-Instruct-FP8.toml"
STAGES = ("queue", "prefill", "hand-off", "first decode step")


def _workload(rate: float, count: int) -> Workload:
    return Workload(
        arrival_pattern="poisson",
        arrival_rate=rate,
        num_requests=count,
        input_len_dist=FixedDist(value=4000),
        output_len_dist=FixedDist(value=500),
        seed=7,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2.5)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "disaggregation_ttft.png")
    args = parser.parse_args()
    base = load_deployment(CONFIG, "h200")
    workload = _workload(args.rate, args.requests)
    rows = []
    for x, y in ((1, 1), (2, 1), (1, 2)):
        pd = run_simulation(split_pd(base, x, y), workload)
        split = pd.disaggregation
        assert split is not None
        stages = [
            s.mean or 0.0
            for s in (
                split.ttft_queue,
                split.ttft_prefill,
                split.ttft_handoff,
                split.ttft_first_decode,
            )
        ]
        agg_dep = attrs.evolve(base, hardware=attrs.evolve(base.hardware, replicas=x + y))
        agg = run_simulation(agg_dep, workload)
        rows.append(
            (
                f"{x}P{y}D",
                stages,
                agg.summary.ttft.mean or 0.0,
                pd.summary.tpot.p50 or 0.0,
                agg.summary.tpot.p50 or 0.0,
            )
        )
    print(
        f"{'layout':8} "
        + " ".join(f"{s:>18}" for s in STAGES)
        + "  TTFT  aggregated  TPOT p50 (pd / agg)"
    )
    for name, stages, agg_ttft, tpot, agg_tpot in rows:
        print(
            f"{name:8} "
            + " ".join(f"{v:18.2f}" for v in stages)
            + f"  {sum(stages):6.1f}  {agg_ttft:10.1f}  {tpot:.2f} / {agg_tpot:.2f}"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 3.4))
    colours = ("#8c8c8c", "#1f77b4", "#ff7f0e", "#2ca02c")
    for i, (_name, stages, agg_ttft, _, _) in enumerate(rows):
        left = 0.0
        for j, value in enumerate(stages):
            ax.barh(i, value, left=left, color=colours[j], label=STAGES[j] if i == 0 else None)
            left += value
        ax.plot(
            [agg_ttft],
            [i],
            marker="|",
            markersize=22,
            color="black",
            label="aggregated, same GPUs" if i == 0 else None,
        )
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlabel("mean TTFT (ms)")
    ax.set_title(f"Llama-3.3-70B FP8 on H200, 4k in / 500 out, {args.rate:g} req/s")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
