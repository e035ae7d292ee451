"""``inference-lab calibrate --table``: a measurement table's rows as deployments and load
levels, one-line errors for bad tables (missing columns, seconds in a millisecond column,
a row that cannot fit its GPU, an under-determined fit), a fit shared by several models
recovering known terms, the hold-outs by model and by load level, the per-group report."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import attrs
import pytest

from inference_lab import cli
from inference_lab.calibrate.fit import (
    Prediction,
    apply,
    check_determined,
    fit,
    mape,
    sim_requests,
    simulate_level,
)
from inference_lab.calibrate.measurements import Measurements, StepSample, start_spread
from inference_lab.calibrate.table import (
    COLUMNS,
    check_units,
    config_finder,
    read_table,
    row_cases,
)
from inference_lab.calibrate.tablefit import fit_entry, group_errors, holdout, pooled
from inference_lab.core.config import load_model_config
from inference_lab.core.roofline import Roofline
from inference_lab.errors import CalibrationError
from tests.configs_util import attention, config_error, dense_config, dumps, gpu_profile

#: The calibrated entry of the test GPU: its profile starts at the datasheet.
ENTRY = "gpu-eng"


def setup_models(tmp_path: Path) -> tuple[Path, Path]:
    """Two dense models of different sizes (1e9 and 4e9 bf16 parameters, 32 layers of KV
    at 8 heads so long contexts weigh), each with the datasheet entry ``gpu`` and the
    calibrated ``gpu-eng``; returns (configs dir, profiles dir)."""
    configs, profiles = tmp_path / "configs", tmp_path / "hardware_profiles"
    configs.mkdir()
    profiles.mkdir()
    (profiles / "gpu.toml").write_text(dumps(gpu_profile()))
    (profiles / f"{ENTRY}.toml").write_text('base = "gpu"\nname = "Test GPU (engine)"\n')
    for name, params in (("small", 1e9), ("large", 4e9)):
        config = dense_config(
            model={
                "name": name,
                "weights": [
                    {"precision": "bf16", "active_params": params, "resident_params": params}
                ],
                "layers": [attention(32, kv_heads=8, head_dim=128)],
            },
            scheduler={"max_num_batched_tokens": 2048, "max_num_seqs": 16},
            hardware={"gpu": {}, ENTRY: {}},
        )
        (configs / f"{name}.toml").write_text(dumps(config))
    return configs, profiles


def row(**cells: Any) -> dict[str, str]:
    """A closed-loop row of the small model on ``gpu-eng`` with ``cells`` changed."""
    base = {c: "" for c in COLUMNS}
    base.update(
        id="r1", source="test", table="t", row="r", column="c", engine="eng",
        scenario="closed_loop", model_config="small", hardware="gpu", entry=ENTRY, tp="1",
        isl="1000", osl="100", level="4", requests="40", ttft_ms="30", tpot_ms="5",
        output_tps="700", split="fit",
    )  # fmt: skip
    base.update({k: str(v) for k, v in cells.items()})
    return base


def write_table(path: Path, rows: list[dict[str, str]], header: tuple[str, ...] = COLUMNS) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(header), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


# ---------------------------------------------------------------------------------------
# rows as cases


def test_a_row_becomes_the_entry_at_its_limits_and_its_mean_lengths(tmp_path: Path) -> None:
    """The row's tp and engine limits replace the entry's; lengths drawn from [0.8 L, L]
    are re-simulated at their mean, (floor(0.8 x 1000) + 1000) / 2 = 900; a closed loop's
    users start spread over one measured request, 30 ms + 99 x 5 ms = 0.525 s."""
    configs, profiles = setup_models(tmp_path)
    table = write_table(
        tmp_path / "t.csv",
        [row(range_ratio="0.8", max_num_seqs="8", max_num_batched_tokens="1024")],
    )
    (case,) = row_cases(read_table(table), config_finder([configs]), profiles)
    assert case.deployment.scheduler.max_num_seqs == 8
    assert case.deployment.scheduler.max_num_batched_tokens == 1024
    assert case.deployment.hardware_name == ENTRY
    assert (case.level.prompt_tokens, case.level.output_tokens) == (900, 90)
    assert case.level.kind == "closed" and case.level.level == 4
    assert case.level.start_spread == pytest.approx(0.030 + 89 * 0.005)


def test_a_fixed_length_closed_loop_is_rerun_in_lock_step(tmp_path: Path) -> None:
    """``vllm bench serve --max-concurrency`` with fixed lengths (no range_ratio) and its
    request count given: every user starts at once and, the requests alike, they stay in
    step, so the row is re-simulated as measured: no start spread, exactly its 8 requests
    (2 per user). Drawn lengths, or no count, keep the steady state's spread and at least
    32 requests. All starting at once, the 4 prompts of 1,000 tokens queue for the
    2,048-token steps: the mean TTFT is longer than with the starts spread."""
    configs, profiles = setup_models(tmp_path)
    rows = [
        row(id="fixed", requests="8"),
        row(id="drawn", requests="8", range_ratio="0.8"),
        row(id="uncounted", requests=""),
    ]
    cases = row_cases(
        read_table(write_table(tmp_path / "t.csv", rows)), config_finder([configs]), profiles
    )
    fixed, drawn, uncounted = (c.level for c in cases)
    assert fixed.lock_step and fixed.start_spread == 0 and sim_requests(fixed, 200) == 8
    for level in (drawn, uncounted):
        assert not level.lock_step and level.start_spread > 0 and sim_requests(level, 200) == 32
    dep = cases[0].deployment
    spread = start_spread(attrs.evolve(fixed, lock_step=False))
    assert simulate_level(dep, fixed, 200)["ttft"] > simulate_level(dep, spread, 200)["ttft"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"header": tuple(c for c in COLUMNS if c not in ("entry", "tp"))},
            "t.csv:1: missing column(s) entry, tp",
        ),
        ({"header": (*COLUMNS, "notes")}, "t.csv:1: unknown column(s) notes"),
        ({"split": "train"}, "t.csv:2: split: must be fit or test"),
        ({"tp": "1.5"}, "t.csv:2: tp: must be a whole number, got '1.5'"),
        ({"ttft_ms": "-3"}, "t.csv:2: ttft_ms: must be > 0, got '-3'"),
        ({"model_config": ""}, "t.csv:2: model_config: must not be blank"),
        ({"ttft_ms": "", "tpot_ms": "", "output_tps": ""}, "t.csv:2: measures nothing"),
        ({"scenario": "online"}, "t.csv:2: scenario: must be one of offline, burst, closed_loop"),
    ],
)
def test_a_bad_table_is_one_line_naming_the_line_and_column(
    tmp_path: Path, change: dict[str, Any], expected: str
) -> None:
    """Missing and unknown columns name the header line; a bad cell names its line and
    column."""
    header = change.pop("header", COLUMNS)
    table = write_table(tmp_path / "t.csv", [row(**change)], header)
    message = config_error(read_table, table)
    assert message.startswith(f"{tmp_path}/{expected}"), message


def test_seconds_in_a_millisecond_column_are_detected_and_said(tmp_path: Path) -> None:
    """TPOT written as 0.005 (seconds) in ``tpot_ms``: the datasheet floor of one decode
    step of the small model at 1,001 positions is (2e9 B + 32 x 4 KiB x 1001 B) / 1 TB/s
    = 2.131 ms, 426x above 0.005 ms; the message says so and gives 5 ms."""
    configs, profiles = setup_models(tmp_path)
    table = write_table(tmp_path / "t.csv", [row(tpot_ms="0.005")])
    (case,) = row_cases(read_table(table), config_finder([configs]), profiles)
    floor = (2e9 + 32 * 4096 * 1001) / 1e12
    message = config_error(check_units, case)
    assert message == (
        f"{table}:2: tpot_ms: 0.005 ms is {floor / 5e-6:.0f}x below the datasheet floor of "
        f"{floor * 1e3:.3g} ms: seconds in a millisecond column? (5 ms if so)"
    )
    (good,) = row_cases(
        read_table(write_table(tmp_path / "g.csv", [row()])), config_finder([configs]), profiles
    )
    check_units(good)  # 5 ms is above the 2.1 ms floor


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"entry": "gpu-x"},
            "t.csv:2: entry: small.toml has no [hardware.gpu-x] (it has gpu, gpu-eng)",
        ),
        ({"model_config": "medium"}, "t.csv:2: model_config: no medium.toml in"),
        (
            {"gpu_memory_utilization": "0.01"},
            "t.csv:2: small does not fit Test GPU (engine) x tp 1: its weights take 2.0 GB of the 1.0 GB the engine may use",
        ),
        (
            {"isl": "1000000"},
            "t.csv:2: one request of 1000000 + 100 tokens needs 62507 KV blocks; small on Test GPU (engine) x tp 1 has 41961",
        ),
    ],
)
def test_a_row_its_config_cannot_serve_is_refused_naming_the_row(
    tmp_path: Path, change: dict[str, str], expected: str
) -> None:
    """No such entry or config, weights that do not fit, one request that does not fit the
    KV cache (1,000,100 positions in blocks of 16: 62,507 blocks; the cache holds
    (90e9 - 2e9) B / (16 x 128 KiB) = 41,961)."""
    configs, profiles = setup_models(tmp_path)
    table = write_table(tmp_path / "t.csv", [row(**change)])
    message = config_error(row_cases, read_table(table), config_finder([configs]), profiles)
    assert message.startswith(f"{tmp_path}/{expected}"), message


# ---------------------------------------------------------------------------------------
# under-determined fits


def steps_of(truth: Roofline, shapes: list[tuple[int, int, int]]) -> Measurements:
    return Measurements(
        steps=tuple(StepSample("s.csv", b, p, c, truth.even_price(b, p, c)) for b, p, c in shapes)
    )


def test_an_under_determined_fit_is_refused_naming_the_terms(tmp_path: Path) -> None:
    """Fewer measured values than terms; a term no measured value moves (FLOP/s, when every
    step is a batch-1 decode: memory-bound by 2,000x); two terms that move every value
    alike (a fixed overhead per step and beta, with alpha 1)."""
    configs, profiles = setup_models(tmp_path)
    dep = load_model_config(configs / "small.toml", profiles).deployments[ENTRY]
    truth = Roofline(dep)
    with pytest.raises(
        CalibrationError,
        match=r"^fit: 1 measured value\(s\) cannot determine 2 terms \(memory_bandwidth, flops\)",
    ):
        fit(dep, steps_of(truth, [(1, 0, 100)]), ["memory_bandwidth", "flops"])
    decodes = steps_of(truth, [(1, 0, 100), (1, 0, 1000), (1, 0, 4000)])
    with pytest.raises(CalibrationError, match=r"^fit: term flops: no measured value moves it"):
        fit(dep, decodes, ["memory_bandwidth", "flops"])
    mixed = steps_of(truth, [(1, 0, 100), (8, 0, 1000), (1, 2000, 1000), (16, 0, 4000)])
    with pytest.raises(
        CalibrationError,
        match=r"^fit: terms step_overhead and beta move the measured values alike \(correlation 1\.0000\)",
    ):
        fit(dep, mixed, ["step_overhead", "beta"])
    fit(dep, mixed, ["memory_bandwidth", "flops"])  # these it can tell apart
    # a dense model routes nothing: the routing skew moves none of its values
    with pytest.raises(
        CalibrationError, match=r"^fit: term expert_skew: no measured value moves it"
    ):
        fit(dep, mixed, ["memory_bandwidth", "expert_skew"])


def test_check_determined_by_hand() -> None:
    """Columns (1, 0) and (0, 1) are determined; (1, 1) and (2, 2) are not."""
    import numpy as np

    upper = np.array([10.0, 10.0])
    check_determined(lambda x: np.array([x[0], x[1]]), np.zeros(2), upper, ["a", "b"], 0.1)
    with pytest.raises(CalibrationError, match="terms a and b"):
        check_determined(
            lambda x: np.array([x[0] + x[1], 2 * (x[0] + x[1])]),
            np.zeros(2),
            upper,
            ["a", "b"],
            0.1,
        )


# ---------------------------------------------------------------------------------------
# a fit shared by several models, and the hold-outs


def synthetic_table(tmp_path: Path, truth: dict[str, float]) -> list[Any]:
    """Rows of both models, bursts of 1, 4 and 12 requests sent at once, "measured" by
    simulating them with ``truth``; returns their cases on the (datasheet-valued) entry."""
    from inference_lab.calibrate.fit import simulate_level

    configs, profiles = setup_models(tmp_path)
    shapes = [("small", 1, 2000, 40), ("small", 4, 2000, 40), ("small", 12, 2000, 40)]
    shapes += [("large", 1, 1500, 30), ("large", 4, 1500, 30), ("large", 12, 1500, 30)]
    plain = [
        row(id=f"{m}-{u}", scenario="burst", model_config=m, level=u, isl=i, osl=o, requests=u)
        for m, u, i, o in shapes
    ]
    cases = row_cases(
        read_table(write_table(tmp_path / "p.csv", plain)), config_finder([configs]), profiles
    )
    measured = []
    for cells, case in zip(plain, cases, strict=True):
        got = simulate_level(
            apply(case.deployment, truth), attrs.evolve(case.level, start_spread=0.0), 96
        )
        measured.append(
            {
                **cells,
                "ttft_ms": repr(got["ttft"] * 1e3),
                "tpot_ms": repr(got["tpot"] * 1e3),
                "output_tps": repr(got["throughput"]),
            }
        )
    table = write_table(tmp_path / "t.csv", measured)
    return row_cases(read_table(table), config_finder([configs]), profiles)


def test_one_fit_over_two_models_recovers_the_shared_terms_and_holds_out(tmp_path: Path) -> None:
    """Rows of a 1B and a 4B model simulated with bandwidth 0.7, FLOP/s 0.5 and 0.3 ms per
    step: the joint fit lands within 1 % of each term with every metric within 0.5 %;
    held out by model, each model is predicted from the other within 1 %; held out by
    load level (each model's levels split at their median), the folds hold out the upper
    levels (12, fitted on 1 and 4) and the lower (1 and 4)."""
    truth = {"memory_bandwidth": 0.7, "flops": 0.5, "step_overhead": 3e-4}
    cases = synthetic_table(tmp_path, truth)
    names = list(truth)
    result = fit_entry(cases, names, cap=96, max_iterations=12)
    for name, value in truth.items():
        assert result.fitted[name] == pytest.approx(value, rel=0.01), result.fitted
    assert all(v < 0.5 for v in mape(result.after).values()), mape(result.after)
    assert len(result.cases_after) == len(cases)
    folds = holdout(cases, names, "model", cap=96, max_iterations=12)
    assert [f.held_out for f in folds] == ["large", "small"]
    for fold in folds:
        assert {c.row["model_config"] for c in fold.tested_on} == {fold.held_out}
        assert all(v[0] < 1.0 for v in pooled(fold.predictions).values()), fold
    levels = holdout(cases, names, "concurrency", cap=96, max_iterations=12)
    assert [f.held_out for f in levels] == ["upper levels (12-12)", "lower levels (1-4)"]
    assert {c.level.level for c in levels[0].tested_on} == {12}


def test_one_model_has_no_model_holdout(tmp_path: Path) -> None:
    configs, profiles = setup_models(tmp_path)
    cases = row_cases(
        read_table(write_table(tmp_path / "t.csv", [row(), row(id="r2", level="8")])),
        config_finder([configs]),
        profiles,
    )
    assert holdout(cases, ["memory_bandwidth"], "model") == []


def test_group_errors_by_hand(tmp_path: Path) -> None:
    """Predicted / measured of 1.1 and 0.8 on TTFT: MAPE 15 %, mean signed error -5 %."""
    configs, profiles = setup_models(tmp_path)
    table = write_table(tmp_path / "t.csv", [row(), row(id="r2", level="8")])
    cases = row_cases(read_table(table), config_finder([configs]), profiles)
    predictions = [Prediction({"ttft": [(1.1, 1.0)]}), Prediction({"ttft": [(0.8, 1.0)]})]
    (by_model,) = group_errors(cases, predictions, "model")
    assert by_model.group == "small" and by_model.rows == 2
    m, bias, n = by_model.metrics["ttft"]
    assert (m, bias, n) == (pytest.approx(15.0), pytest.approx(-5.0), 2)
    by_level = group_errors(cases, predictions, "level")
    assert [g.group for g in by_level] == ["closed 4", "closed 8"]
    assert by_level[1].metrics["ttft"][:2] == (pytest.approx(20.0), pytest.approx(-20.0))


# ---------------------------------------------------------------------------------------
# the command


def test_calibrate_table_reports_per_model_and_level_and_writes_the_profile_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table mode prints the fit, the residuals per model and per load level, the
    model hold-out, and writes ``[efficiency]`` / ``[overheads]`` tables that load as the
    profile's."""
    import tomllib

    truth = {"memory_bandwidth": 0.7, "flops": 0.5, "step_overhead": 3e-4}
    cases = synthetic_table(tmp_path, truth)
    out = tmp_path / "eff.toml"
    argv = [
        "calibrate", "--table", str(tmp_path / "t.csv"), "--entry", ENTRY,
        "--configs-dir", str(tmp_path / "configs"), "--profiles-dir", str(tmp_path / "hardware_profiles"),
        "--fit", "memory_bandwidth,flops,seq_overhead", "--holdout", "model",
        "--sim-requests", "96", "-o", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"calibrate  {ENTRY} from" in printed and "2 model(s) (large, small)" in printed
    assert "residuals per model" in printed and "residuals per load level" in printed
    assert "held out by model" in printed and "  large: 3 rows:" in printed
    tables = tomllib.loads(out.read_text())
    assert set(tables) == {"efficiency", "overheads"}
    profile = tmp_path / "hardware_profiles" / f"{ENTRY}.toml"
    profile.write_text(profile.read_text() + "\n" + out.read_text())
    dep = load_model_config(
        tmp_path / "configs" / "small.toml", tmp_path / "hardware_profiles"
    ).deployments[ENTRY]
    assert dep.efficiency.flops == pytest.approx(tables["efficiency"]["flops"])
    assert dep.overheads.seq_overhead == pytest.approx(tables["overheads"]["seq_overhead"])
    assert len(cases) == 6


def test_every_fitted_term_is_reported_in_its_unit() -> None:
    """The reports print a fraction bare, a time term in ms or µs as the solver steps it
    (the time per layer in µs), the reserved memory in GB: each report of a fit naming
    ``layer_overhead`` says it in µs."""
    from inference_lab.calibrate.cli import format_report
    from inference_lab.calibrate.fit import FitResult, shown
    from inference_lab.calibrate.table_cli import format_fit

    assert shown("flops", 0.5) == "0.5"
    assert shown("step_overhead", 3.26e-3) == "3.26 ms"
    assert shown("seq_overhead", 1.382e-4) == "138.2 us"
    assert shown("layer_overhead", 1.679e-4) == "167.9 us"
    assert shown("reserved_memory", 2e9) == "2 GB"
    same = Prediction({"ttft": [(1.0, 1.0)]})
    result = FitResult(
        names=("flops", "layer_overhead"), initial=(1.0, 0.0), values=(0.5, 1.679e-4),
        before=same, after=same, evaluations=1, iterations=1,
    )  # fmt: skip
    line = "flops 0.5 (from 1), layer_overhead 167.9 us (from 0 us)"
    assert line in format_fit(result) and line in format_report(result)


@pytest.mark.parametrize(
    ("argv", "code", "line"),
    [
        (["--table", "t.csv"], 2, "--table: needs --entry"),
        (
            ["--table", "t.csv", "--entry", "x", "m.json"],
            2,
            "--table: fits the table's rows; give no --config or files with it",
        ),
        (
            ["--entry", "x", "--config", "c.toml", "m.json"],
            2,
            "--entry and --holdout go with --table",
        ),
        ([], 2, "needs --config and measurement files, or --table and --entry"),
        (["--table", "missing.csv", "--entry", "x"], 1, "missing.csv: no such file"),
    ],
)
def test_calibrate_table_flags_that_do_not_go_together(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int, line: str
) -> None:
    assert cli.main(["calibrate", *argv]) == code
    err = capsys.readouterr().err
    assert err.startswith(f"inference-lab calibrate: error: {line}") and err.count("\n") == 1, err


def test_the_seq_overhead_is_one_per_sequence_in_the_step(tmp_path: Path) -> None:
    """``[overheads] seq_overhead`` adds exactly n x s to a step of n sequences (20 us x 16
    decodes = 320 us), nothing to an empty one, and 0 changes no price."""
    configs, profiles = setup_models(tmp_path)
    dep = load_model_config(configs / "small.toml", profiles).deployments[ENTRY]
    plain, host = Roofline(dep), Roofline(apply(dep, {"seq_overhead": 2e-5}))
    for batch, prefill, context in ((16, 0, 1000), (1, 511, 300), (4, 0, 10)):
        gap = host.even_price(batch, prefill, context) - plain.even_price(batch, prefill, context)
        assert gap == pytest.approx(batch * 2e-5, rel=1e-9)
    terms = plain.batch_terms([1] * 16, [1000] * 16)
    assert host.price(terms).seconds - plain.price(terms).seconds == pytest.approx(
        16 * 2e-5, rel=1e-9
    )
    zero = Roofline(apply(dep, {"seq_overhead": 0.0}))
    assert zero.price(terms) == plain.price(terms)
    assert math.isfinite(plain.price(terms).seconds)


def test_the_profiles_frontend_latency_is_added_to_each_entrys_scheduler(tmp_path: Path) -> None:
    """``[overheads] frontend_latency = 0.002`` on the profile and 1 ms in ``[scheduler]``: the
    entry loads with 3 ms; an entry whose own ``overheads`` table sets 0 keeps 1 ms."""
    configs, profiles = setup_models(tmp_path)
    profile = profiles / f"{ENTRY}.toml"
    profile.write_text(profile.read_text() + "\n[overheads]\nfrontend_latency = 0.002\n")
    config = dense_config(
        scheduler={"max_num_batched_tokens": 2048, "max_num_seqs": 16, "frontend_latency": 0.001},
        hardware={ENTRY: {}, "own": {"profile": ENTRY, "overheads": {"frontend_latency": 0.0}}},
    )
    path = tmp_path / "c.toml"
    path.write_text(dumps(config))
    deps = load_model_config(path, profiles).deployments
    assert deps[ENTRY].scheduler.frontend_latency == pytest.approx(0.003)
    assert deps[ENTRY].overheads.frontend_latency == 0.002
    assert deps["own"].scheduler.frontend_latency == 0.001


def test_the_reserved_memory_leaves_the_kv_cache(tmp_path: Path) -> None:
    """``[overheads] reserved_memory = 8e9`` at tp 2: the KV cache is the pool (2 x 100e9 x 0.9
    = 180e9) less the weights (2e9) less 2 x 8e9 = 162e9 bytes; 0 leaves 178e9."""
    configs, profiles = setup_models(tmp_path)
    dep = load_model_config(configs / "small.toml", profiles).deployments[ENTRY]
    dep = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, tp=2))
    assert dep.kv_bytes == 178e9
    assert apply(dep, {"reserved_memory": 8e9}).kv_bytes == 162e9
    assert apply(dep, {"reserved_memory": 8e9}).total_blocks == math.floor(162e9 / (16 * 131072))


def test_a_level_that_did_not_run_is_counted_not_averaged() -> None:
    """A prediction that is MISSING's stand-in (1,000 x the measured value) is left out of
    the MAPE and counted as not run; the fit still sees it (a residual of ln 1000)."""
    from inference_lab.calibrate.fit import MISSING, is_missing
    from inference_lab.calibrate.tablefit import not_run

    ran = Prediction({"ttft": [(1.2, 1.0)], "tpot": [(0.9, 1.0)]})
    failed = Prediction({"ttft": [(MISSING * 2.0, 2.0)], "tpot": [(MISSING * 0.5, 0.5)]})
    assert is_missing(MISSING * 2.0, 2.0) and not is_missing(1.2, 1.0)
    errors = pooled([ran, failed])
    assert errors["ttft"] == (pytest.approx(20.0), pytest.approx(20.0), 1)
    assert not_run([ran, failed]) == 1
    assert failed.residuals()[0] == pytest.approx(math.log(MISSING))


def test_a_fold_its_rows_cannot_determine_is_reported_not_fitted(tmp_path: Path) -> None:
    """Two load levels of one model held out by load range: each fold fits one row (three
    measured values) and cannot determine four terms; both folds say so and predict
    nothing."""
    configs, profiles = setup_models(tmp_path)
    table = write_table(tmp_path / "t.csv", [row(), row(id="r2", level="8", requests="80")])
    cases = row_cases(read_table(table), config_finder([configs]), profiles)
    names = ["memory_bandwidth", "flops", "step_overhead", "seq_overhead"]
    folds = holdout(cases, names, "concurrency", cap=32)
    assert [f.held_out for f in folds] == ["upper levels (8-8)", "lower levels (4-4)"]
    for fold in folds:
        assert fold.unfitted.startswith("fit: 3 measured value(s) cannot determine 4 terms")
        assert fold.predictions == () and fold.values == {}
