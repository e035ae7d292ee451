"""The median inter-token latency as a measured metric: the streams' gaps (``sim.itl``),
the table's ``itl_median_ms`` column, its re-simulation by hand, its unit check, and its
place among a fit's residuals."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from inference_lab.calibrate.fit import Prediction, predict, simulate_level
from inference_lab.calibrate.measurements import Measurements
from inference_lab.calibrate.table import check_units, config_finder, read_table, row_cases
from inference_lab.core.engine import Finished, StepEvents
from inference_lab.sim.itl import ItlRecorder
from tests.configs_util import config_error
from tests.test_calibrate_table import row, setup_models, write_table


def _events(
    time: float, tokens: tuple[tuple[int, int], ...], done: tuple[int, ...] = ()
) -> StepEvents:
    finished = tuple(
        Finished(
            request_id=rid,
            prompt_tokens=1,
            output_tokens=1,
            finish_reason="length",
            arrival_time=0.0,
            first_scheduled_time=0.0,
            first_token_time=0.0,
            finish_time=time,
            preemptions=0,
        )  # fmt: skip
        for rid in done
    )
    return StepEvents(time=time, tokens=tokens, finished=finished, arrived=(), step=None)


def test_the_gaps_by_hand() -> None:
    """Request 1's first token at 1.0 opens its stream; its tokens at 1.5 and 3.0 add gaps
    of 0.5 and 1.5. Request 2 gets 3 tokens at 2.0 (its first: no gap, then two gaps of 0,
    arriving together), 1 at 2.25 (0.25) and finishes; its id seen again at 4.0 opens a
    new stream. Gaps: 0.5, 0, 0, 0.25, 1.5: median 0.25, and numpy's linear 75th
    percentile of the five is 0.5."""
    itl = ItlRecorder()
    assert itl.median() is None and itl.percentiles(np.array([50.0])) is None
    itl.observe(_events(1.0, ((1, 1),)))
    itl.observe(_events(1.5, ((1, 1),)))
    itl.observe(_events(2.0, ((2, 3),)))
    itl.observe(_events(2.25, ((2, 1),), done=(2,)))
    itl.observe(_events(3.0, ((1, 1),)))
    itl.observe(_events(4.0, ((2, 1),)))
    assert sorted(itl.gaps) == [0.0, 0.0, 0.25, 0.5, 1.5]
    assert itl.median() == 0.25
    got = itl.percentiles(np.array([75.0]))
    assert got is not None and got[0] == 0.5


def test_a_row_with_itl_is_read_in_seconds_and_resimulated_by_hand(tmp_path: Path) -> None:
    """One request of 1,000 + 5 tokens alone on the small model (2e9 bytes of bf16
    weights, 32 x 4 KiB of KV a position, 1 TB/s, the datasheet's): its four decode
    steps attend 1,001 ... 1,004 positions and each reads the weights and that KV, so the
    median of the four gaps is the mean of the middle two steps: (2e9 + 32 x 4096 x
    1,002.5) / 1e12 s. The row's 3 ms is read as 0.003 s."""
    configs, profiles = setup_models(tmp_path)
    cells = row(scenario="burst", level=1, requests=1, isl=1000, osl=5, itl_median_ms="3")
    (case,) = row_cases(
        read_table(write_table(tmp_path / "t.csv", [cells])), config_finder([configs]), profiles
    )
    assert case.level.itl == pytest.approx(0.003)
    got = simulate_level(case.deployment, case.level, 16)
    assert got["itl"] == pytest.approx((2e9 + 32 * 4096 * 1002.5) / 1e12, rel=1e-12)
    plain = simulate_level(case.deployment, attrs.evolve(case.level, itl=None), 16)
    assert "itl" not in plain  # recorded only where measured
    assert plain == {k: v for k, v in got.items() if k != "itl"}


def test_a_row_measuring_only_the_median_itl_is_a_row(tmp_path: Path) -> None:
    table = write_table(
        tmp_path / "t.csv", [row(ttft_ms="", tpot_ms="", output_tps="", itl_median_ms="4")]
    )
    (only,) = read_table(table)
    assert only.measured() == {"itl": pytest.approx(0.004)}
    blank = write_table(tmp_path / "b.csv", [row(ttft_ms="", tpot_ms="", output_tps="")])
    message = config_error(read_table, blank)
    assert message.endswith(
        "b.csv:2: measures nothing: output_tps, ttft_ms, tpot_ms and itl_median_ms are blank"
    )


def test_seconds_in_the_itl_column_are_detected_and_said(tmp_path: Path) -> None:
    """The median ITL has the decode step's floor (2.131 ms for the small model at 1,001
    positions, as ``tpot_ms``'s): 0.005 there is seconds."""
    configs, profiles = setup_models(tmp_path)
    table = write_table(tmp_path / "t.csv", [row(itl_median_ms="0.005")])
    (case,) = row_cases(read_table(table), config_finder([configs]), profiles)
    floor = (2e9 + 32 * 4096 * 1001) / 1e12
    assert config_error(check_units, case) == (
        f"{table}:2: itl_median_ms: 0.005 ms is {floor / 5e-6:.0f}x below the datasheet floor "
        f"of {floor * 1e3:.3g} ms: seconds in a millisecond column? (5 ms if so)"
    )


def test_the_median_itl_is_one_of_the_fits_residuals(tmp_path: Path) -> None:
    """A measured median ITL is predicted and enters the residuals beside TTFT and TPOT
    (Rule 2: the log of predicted / measured)."""
    configs, profiles = setup_models(tmp_path)
    cells = row(scenario="burst", level=1, requests=1, isl=1000, osl=5, itl_median_ms="3")
    (case,) = row_cases(
        read_table(write_table(tmp_path / "t.csv", [cells])), config_finder([configs]), profiles
    )
    prediction = predict(case.deployment, Measurements(levels=(case.level,)), 16)
    ((predicted, measured),) = prediction.pairs["itl"]
    assert measured == pytest.approx(0.003)
    assert predicted == pytest.approx((2e9 + 32 * 4096 * 1002.5) / 1e12, rel=1e-12)
    logs = Prediction({"itl": [(predicted, measured)]}).residuals()
    assert logs.tolist() == [pytest.approx(np.log(predicted / measured))]


def test_calibrate_table_reports_the_median_itl_per_model_and_held_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``calibrate --table`` on rows that measure the median ITL: it is fitted, and the
    residuals per model and per level and each held-out model report it."""
    from inference_lab import cli
    from inference_lab.calibrate.fit import apply
    from tests.test_calibrate_table import ENTRY

    configs, profiles = setup_models(tmp_path)
    truth = {"memory_bandwidth": 0.7, "flops": 0.5}
    shapes = [(m, u) for m in ("small", "large") for u in (1, 4, 12)]
    plain = [
        row(id=f"{m}-{u}", scenario="burst", model_config=m, level=u, requests=u, osl=20)
        for m, u in shapes
    ]
    cases = row_cases(
        read_table(write_table(tmp_path / "p.csv", plain)), config_finder([configs]), profiles
    )
    measured = []
    for cells, case in zip(plain, cases, strict=True):
        level = attrs.evolve(case.level, start_spread=0.0, itl=1.0)
        got = simulate_level(apply(case.deployment, truth), level, 96)
        measured.append(
            {**cells, "ttft_ms": repr(got["ttft"] * 1e3), "tpot_ms": "",
             "output_tps": "", "itl_median_ms": repr(got["itl"] * 1e3)}
        )  # fmt: skip
    table = write_table(tmp_path / "t.csv", measured)
    argv = [
        "calibrate", "--table", str(table), "--entry", ENTRY,
        "--configs-dir", str(configs), "--profiles-dir", str(profiles),
        "--fit", "memory_bandwidth,flops", "--holdout", "model", "--sim-requests", "96",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "\nitl " in printed  # the MAPE before and after
    header = next(line for line in printed.splitlines() if line.strip().startswith("rows"))
    assert header.split()[1:] == ["TTFT", "ITL", "p50"]
    held = [line for line in printed.splitlines() if line.startswith("  large: 3 rows:")]
    assert len(held) == 1 and "ITL p50 " in held[0]


def test_the_load_reader_takes_the_pooled_median_itl(tmp_path: Path) -> None:
    """``inference-lab load -o``'s ``summary.itl`` pools every gap between a request's
    tokens (``client/report.py``), as ``sim.itl`` does: its ``p50`` is the level's median
    ITL; without it the level has none; a negative one is a one-line error."""
    import json

    from inference_lab.calibrate.measurements import read_measurements
    from inference_lab.client.report import Distribution, Summary
    from tests.test_calibrate import load_export

    assert "itl" in attrs.fields_dict(Summary) and "p50" in attrs.fields_dict(Distribution)
    path = tmp_path / "load.json"
    path.write_text(json.dumps(load_export(summary={"itl": {"mean": 0.005, "p50": 0.0042}})))
    (level,) = read_measurements([path], "tiny-dense").levels
    assert level.itl == 0.0042
    assert level.measured()["itl"] == 0.0042
    path.write_text(json.dumps(load_export()))
    (plain,) = read_measurements([path], "tiny-dense").levels
    assert plain.itl is None and "itl" not in plain.measured()
    path.write_text(json.dumps(load_export(summary={"itl": {"p50": -1}})))
    message = config_error(read_measurements, [path], "tiny-dense")
    assert message.startswith(f"{path}: summary.itl.p50"), message
