"""``inference-lab sim`` on speculative and data-parallel deployments: the summary's mean
acceptance length and speed-up (summary Rule 6), the JSON, the configuration lines; and
a run without ``[speculative]`` prints none of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference_lab import cli
from inference_lab.core.engine import StepInfo
from inference_lab.sim.summary import speculative_summary

ROOT = Path(__file__).resolve().parent.parent
EAGLE = str(ROOT / "configs" / "frontier" / "Llama-3.1-8B-Instruct-EAGLE.toml")
DEEPSEEK = str(ROOT / "configs" / "frontier" / "DeepSeek-V3.toml")
QUICK = str(ROOT / "configs" / "workloads" / "quick.toml")


def step(duration: float, drafts: int = 0, accepted: int = 0, plain: float = 0.0) -> StepInfo:
    return StepInfo(
        worker=0,
        start=0.0,
        duration=duration,
        num_seqs=1,
        num_tokens=1,
        kv_usage=0.0,
        flop_util=0.0,
        bw_util=0.0,
        preempted=0,
        drafts=drafts,
        draft_tokens=3 * drafts,
        accepted_tokens=accepted,
        plain_duration=plain,
    )


def test_the_summary_counts_as_vllm_and_weighs_the_steps_plain_durations() -> None:
    """Two verify steps (4 drafts accepting 6, 2 accepting 1) and a prefill step: mean
    acceptance length 1 + 7/6, acceptance 7 of 18 draft tokens; speed-up (the prefill
    step counts as itself) (0.010 + 0.008 + 0.005) / (0.004 + 0.005 + 0.005) = 1.642857."""
    summary = speculative_summary([step(0.004, 4, 6, 0.010), step(0.005, 2, 1, 0.008), step(0.005)])
    assert summary.mean_acceptance_length == pytest.approx(1 + 7 / 6)
    assert summary.acceptance_rate == pytest.approx(7 / 18)
    assert summary.speedup == pytest.approx(0.023 / 0.014)
    assert summary.to_dict()["drafts"] == 6


def test_sim_prints_acceptance_length_and_speed_up(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The EAGLE Llama at 2 requests/s: a speculative configuration line, and a summary
    line with the mean acceptance length near 2.53 (1 + 0.7 + 0.49 + 0.343) and a speed-up
    above 1.5 (a nearly idle server); the JSON carries the same figures."""
    out = tmp_path / "r.json"
    rc = cli.main(
        ["sim", "--config", EAGLE, "--hardware", "h200", "--workload", QUICK, "-o", str(out)]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "speculative eagle: 3 draft token(s) per step (model drafter)" in text
    line = next(x for x in text.splitlines() if x.startswith("speculative  "))
    assert "mean acceptance length 2.5" in line
    doc = json.loads(out.read_text())
    spec = doc["speculative"]
    assert spec["mean_acceptance_length"] == pytest.approx(2.533, abs=0.05)
    assert spec["speedup"] > 1.5
    assert doc["config"]["speculative"]["num_speculative_tokens"] == 3
    assert doc["config"]["speculative"]["rates"] == pytest.approx([0.7, 0.49, 0.343])


def test_a_dp_attention_deployment_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V3 on 8 x H200: ep and dp attention in the hardware line, the KV cache per
    attention rank, one replica line per rank."""
    rc = cli.main(["sim", "--config", DEEPSEEK, "--hardware", "h200", "--workload", QUICK])
    text = capsys.readouterr().out
    assert rc == 0
    assert "NVIDIA H200 x tp 8, ep 8, dp attention 8, 1 replica" in text
    assert "5,323 blocks of 64 tokens per attention rank" in text
    assert "replicas     8:" in text


def test_without_speculation_nothing_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(
        ["sim", "--config", str(ROOT / "configs" / "gpt-oss-20b.toml"), "--hardware", "b200",
         "--workload", QUICK]
    )  # fmt: skip
    assert rc == 0
    assert "speculative" not in capsys.readouterr().out
