"""`sim`'s capacity verdict (`inference_lab.sim.capacity`): one line under the table, and
the same in the JSON, when an open-loop workload asks more than the deployment serves;
nothing for runs that keep up or for closed loops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from inference_lab import cli
from inference_lab.sim.capacity import MIN_ARRIVALS, assess_capacity

ROOT = Path(__file__).resolve().parent.parent
GPT_OSS = str(ROOT / "configs" / "gpt-oss-20b.toml")
QUICK = str(ROOT / "configs" / "workloads" / "quick.toml")
CLOSED = str(ROOT / "configs" / "workloads" / "chat-closed-64.toml")

#: 300 requests at 200/s against a batch of 2: far beyond what the deployment serves.
FLOOD = (
    'arrival_pattern = "uniform"\narrival_rate = 200.0\nnum_requests = 300\n'
    'input_len_dist = { type = "fixed", value = 100 }\n'
    'output_len_dist = { type = "fixed", value = 50 }\nseed = 1\n'
)


def sim(
    capsys: pytest.CaptureFixture[str], out: Path, *argv: str
) -> tuple[list[str], dict[str, Any]]:
    rc = cli.main(["sim", "--config", GPT_OSS, "--hardware", "b200", "-q", "-o", str(out), *argv])
    assert rc == 0
    return capsys.readouterr().out.splitlines(), json.loads(out.read_text())


def test_an_open_loop_beyond_capacity_says_so_under_the_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The line right under the latency table gives the offered and the served rate over
    the second half of the arrivals and the queue's growth; the JSON's `capacity` holds
    the same numbers and line."""
    wl = tmp_path / "flood.toml"
    wl.write_text(FLOOD)
    lines, doc = sim(capsys, tmp_path / "r.json", "--workload", str(wl), "--max-num-seqs", "2")
    row = next(i for i, line in enumerate(lines) if line.startswith("queue"))
    line = lines[row + 1]
    cap = doc["capacity"]
    assert cap["over"] is True and cap["message"] == line
    assert line.startswith("over capacity: requests arrived at ")
    assert f"arrived at {cap['offered_rps']:,.2f}/s" in line
    assert f"completed at {cap['served_rps']:,.2f}/s" in line
    assert cap["offered_rps"] == pytest.approx(200, rel=0.02)
    assert cap["served_rps"] < 0.9 * cap["offered_rps"]
    assert cap["waiting_at_end"] > cap["waiting_at_mid"] > 0
    assert f"grew from {cap['waiting_at_mid']:,} to {cap['waiting_at_end']:,}" in line
    assert cap["rejected"] == 0


def test_with_max_waiting_the_line_counts_the_refused_arrivals(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With the queue bounded, the backlog shows as refusals, not as a growing queue."""
    wl = tmp_path / "flood.toml"
    wl.write_text(FLOOD)
    argv = ("--workload", str(wl), "--max-num-seqs", "2", "--max-waiting", "5")
    lines, doc = sim(capsys, tmp_path / "r.json", *argv)
    cap = doc["capacity"]
    assert cap["over"] is True and cap["rejected"] > 0
    assert cap["waiting_at_end"] <= 5
    assert f"max_waiting refused {cap['rejected']:,} of those arrivals" in cap["message"]
    assert cap["message"] in lines


def test_runs_that_keep_up_print_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An open loop the deployment keeps up with gets a verdict (JSON) but no line; a
    closed loop gets none at all."""
    lines, doc = sim(capsys, tmp_path / "r.json", "--workload", QUICK)
    assert doc["capacity"]["over"] is False and doc["capacity"]["message"] is None
    assert not any("capacity" in line for line in lines)
    lines, doc = sim(capsys, tmp_path / "r.json", "--workload", CLOSED, "--max-num-seqs", "8")
    assert doc["capacity"] is None
    assert not any("capacity" in line for line in lines)


def uniform(n: int, rate: float, start: float = 0.0) -> list[float]:
    return [start + i / rate for i in range(n)]


def test_the_verdict_needs_a_slower_service_and_a_backlog() -> None:
    """Over capacity only when completions in the window fall short of arrivals by more
    than the margin and the queue grew (or the bound refused arrivals)."""
    arrivals = uniform(100, 10.0)  # 0 .. 9.9 s, window (4.95, 9.9]
    kept_up = [t + 0.5 for t in arrivals]
    slow = uniform(30, 3.0, start=0.5)
    verdict = assess_capacity(arrivals, kept_up, waiting_at_mid=0, waiting_at_end=0)
    assert verdict is not None and not verdict.over
    assert verdict.offered_rps == pytest.approx(verdict.served_rps, rel=0.05)
    # slower, but the queue did not grow: not enough
    verdict = assess_capacity(arrivals, slow, waiting_at_mid=3, waiting_at_end=3)
    assert verdict is not None and not verdict.over
    # the queue grew, but requests complete as fast as they arrive: not enough either
    verdict = assess_capacity(arrivals, kept_up, waiting_at_mid=1, waiting_at_end=2)
    assert verdict is not None and not verdict.over
    # both
    verdict = assess_capacity(arrivals, slow, waiting_at_mid=3, waiting_at_end=40)
    assert verdict is not None and verdict.over
    assert verdict.served_rps == pytest.approx(15 / 4.95)
    # refusals by max_waiting inside the window count as the backlog
    verdict = assess_capacity(
        arrivals, slow, rejected=[9.0, 9.5], waiting_at_mid=5, waiting_at_end=5
    )
    assert verdict is not None and verdict.over and verdict.rejected == 2


def test_no_verdict_without_a_rate_to_compare() -> None:
    """Arrivals at one instant (batched), or too few in the window: no verdict."""
    assert assess_capacity([0.0] * 500, [1.0] * 500, waiting_at_mid=0, waiting_at_end=0) is None
    few = uniform(2 * MIN_ARRIVALS - 2, 10.0)
    assert assess_capacity(few, [], waiting_at_mid=0, waiting_at_end=9) is None
    assert assess_capacity([], [], waiting_at_mid=0, waiting_at_end=0) is None
