"""``inference-lab sim`` on a disaggregated deployment: ``--pd xPyD``, the pools, the
transfers and TTFT's four stages (``sim/disaggregation.py``), and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from inference_lab import cli
from inference_lab.core.config import load_deployment, load_workload, split_pd
from inference_lab.errors import ConfigError
from inference_lab.sim.run import run_simulation
from tests.engine_util import LLAMA8B, ROOT

WORKLOAD = ROOT / "configs" / "workloads" / "chat-poisson-5rps.toml"


def test_the_ttft_stages_add_up_to_the_ttft() -> None:
    """Rule 2 of ``sim/disaggregation.py``: per request, queue + prefill + hand-off +
    first decode step is its TTFT, so the stages' means add up to TTFT's mean."""
    dep = split_pd(load_deployment(LLAMA8B, "h100"), 2, 1)
    workload = attrs.evolve(load_workload(WORKLOAD), num_requests=120)
    result = run_simulation(dep, workload)
    pd = result.disaggregation
    assert pd is not None and result.summary.ttft.mean is not None
    means = [pd.ttft_queue.mean, pd.ttft_prefill.mean, pd.ttft_handoff.mean]
    means.append(pd.ttft_first_decode.mean)
    assert all(m is not None for m in means)
    assert sum(m for m in means if m is not None) == pytest.approx(result.summary.ttft.mean)
    assert pd.transfers == 120 and pd.prefill.replicas == 2 and pd.decode.replicas == 1
    assert 0 < pd.decode.busy_share <= 1 and 0 < pd.prefill.busy_share < pd.decode.busy_share
    assert {r.prefill_worker for r in result.finished} == {0, 1}


def test_sim_pd_prints_and_writes_the_pools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    argv = ["sim", "--config", str(LLAMA8B), "--hardware", "h100", "--workload", str(WORKLOAD)]
    assert cli.main([*argv, "--pd", "1P1D", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pools        prefill 1 x h100 (tp 1)" in text
    assert "transfers    " in text and "TTFT stages" in text
    doc = json.loads(out.read_text())
    assert doc["disaggregation"]["decode"]["replicas"] == 1
    assert set(doc["disaggregation"]) >= {"ttft_queue", "ttft_handoff", "transfer_bytes_mean"}


@pytest.mark.parametrize("value", ["2X1", "0P1D", "1P2000D", "P1D"])
def test_a_bad_pd_is_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--config", str(LLAMA8B), "--hardware", "h100", "--workload", str(WORKLOAD)]
    assert cli.main([*argv, "--pd", value]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("inference-lab sim: error: argument --pd")


def test_max_waiting_with_disaggregation_is_refused_in_one_line() -> None:
    dep = split_pd(load_deployment(LLAMA8B, "h100"), 1, 1)
    dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, max_waiting=8))
    with pytest.raises(ConfigError) as err:
        run_simulation(dep, load_workload(WORKLOAD))
    assert "max_waiting with [disaggregation]" in str(err.value) and "\n" not in str(err.value)
