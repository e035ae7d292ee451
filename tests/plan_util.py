"""Helpers for the planner's tests: a small plan spec written under ``tmp_path`` (short
requests, probes of half a simulated second, so a whole plan takes seconds), synthetic
probe results for the search, and a plan's answer reduced to comparable values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from inference_lab.plan.jobs import ITL_PERCENTILES, ProbeResult
from inference_lab.plan.planner import PlanResult
from inference_lab.sim.summary import RequestLatencies

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"

WORKLOAD = """\
arrival_pattern = "poisson"
arrival_rate = 10.0
num_requests = 100
input_len_dist = { type = "uniform", min = 32, max = 256 }
output_len_dist = { type = "uniform", min = 4, max = 32 }
seed = 7
"""

SPEC = f"""\
workload = "workload.toml"
models = ["{CONFIGS / "gpt-oss-20b.toml"}", "{CONFIGS / "Llama-3-70B.toml"}"]
hardware = ["h100", "b200"]
tp = [1]
replicas = [1, 2]

[search]
duration_s = 0.5
min_requests = 20
start_rate = 40
max_rate = 1500
rel_tol = 0.25

[slo.tight]
ttft_p99_ms = 30

[slo.loose]
e2e_p90_ms = 200
tpot_p50_ms = 10
"""


def write_spec(tmp_path: Path, text: str = SPEC, name: str = "plan.toml") -> Path:
    """The spec (and its workload) under ``tmp_path``; returns the spec's path."""
    (tmp_path / "workload.toml").write_text(WORKLOAD)
    path = tmp_path / name
    path.write_text(text)
    return path


def answer(result: PlanResult) -> list[tuple[Any, ...]]:
    """What a plan decided, per candidate and SLO set: the rate, whether it was capped, the
    reason, and every probe (rate, passed) in order; equal plans give equal lists."""
    out = []
    for cr in result.candidates:
        out.append((cr.candidate.index, cr.candidate.error))
        for name, o in sorted(cr.outcomes.items()):
            out.append((name, o.max_rate, o.capped, o.reason, o.probes))
    return out


def fake_probe(
    rate: float,
    ttft_s: list[float],
    *,
    tpot_s: list[float] | None = None,
    output_tokens: list[int] | None = None,
    refused: int = 0,
    error: str = "",
    requests: int | None = None,
) -> ProbeResult:
    """A probe result with the given per-request TTFTs (E2E = TTFT, queue 0) and ITL
    percentiles rising linearly from 0 to 10 ms."""
    n = len(ttft_s)
    ttft = np.array(ttft_s, dtype=np.float64)
    return ProbeResult(
        key=f"fake-{rate}",
        rate=rate,
        requests=n + refused if requests is None else requests,
        completed=n,
        refused=refused,
        refusal="prompt too long" if refused else "",
        error=error,
        span_s=1.0,
        latencies=RequestLatencies(
            ttft=ttft,
            tpot=np.array(tpot_s if tpot_s is not None else [0.001] * n, dtype=np.float64),
            e2e=ttft.copy(),
            queue=np.zeros(n),
            output_tokens=np.array(output_tokens or [10] * n, dtype=np.int64),
        ),
        itl=ITL_PERCENTILES / 100 * 0.010,
    )
