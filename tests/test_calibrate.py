"""``inference-lab calibrate``: the measurement readers (load, aiperf, guidellm, step CSV),
the fit recovering known parameters from measurements generated with them, the TOML
snippet, and one-line errors for bad input."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import attrs
import pytest

from inference_lab import cli
from inference_lab.calibrate.fit import apply, fit, mape, simulate_level
from inference_lab.calibrate.measurements import LoadLevel, Measurements, read_measurements
from inference_lab.client.report import Summary
from inference_lab.core.config import Deployment, load_model_config
from inference_lab.core.roofline import Roofline
from tests.configs_util import attention, config_error, dense_config, write_setup


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, Deployment]:
    """The dense test model with 32 attention layers of 8 KV heads (128 KiB of KV per
    position, so long contexts move the step time as much as the weights do and the
    bandwidth and the overhead can be told apart), on the test GPU, with a scheduler small
    enough that the re-simulated levels are quick."""
    config = dense_config(
        scheduler={"max_num_batched_tokens": 2048, "max_num_seqs": 16},
        model={"layers": [attention(32, kv_heads=8, head_dim=128)]},
    )
    path, profiles = write_setup(tmp_path, config)
    return path, profiles, load_model_config(path, profiles).deployments["gpu"]


def levels_measured_on(truth: Deployment) -> Measurements:
    """Three closed-loop levels and one open-loop level, "measured" on ``truth``."""
    shapes = [("closed", 1, 200, 40), ("closed", 4, 1500, 40), ("closed", 16, 3000, 30)]
    shapes.append(("open", 20.0, 300, 30))
    levels = []
    for kind, level, prompt, output in shapes:
        plain = LoadLevel(
            source="synthetic", kind=kind, level=level, prompt_tokens=prompt, output_tokens=output
        )
        levels.append(attrs.evolve(plain, **simulate_level(truth, plain, 200)))
    return Measurements(levels=tuple(levels))


# ---------------------------------------------------------------------------------------
# recovering known parameters


def test_the_fit_recovers_efficiency_terms_from_levels_generated_with_them(
    setup: tuple[Path, Path, Deployment],
) -> None:
    """Levels simulated with bandwidth 0.7, FLOP/s 0.5 and a 0.3 ms step overhead are fitted
    back to those values (within 1 %: a simulation's events are discrete, so its metrics
    move in small steps) from the datasheet start (1.0, 1.0, 0), and the error of every
    metric falls from over 10 % to under 0.5 %."""
    _, _, dep = setup
    truth = {"memory_bandwidth": 0.7, "flops": 0.5, "step_overhead": 3e-4}
    data = levels_measured_on(apply(dep, truth))
    result = fit(dep, data, ["memory_bandwidth", "flops", "step_overhead"], cap=200)
    for name, value in truth.items():
        assert result.fitted[name] == pytest.approx(value, rel=1e-2), result.fitted
    before, after = mape(result.before), mape(result.after)
    assert set(before) == {"ttft", "tpot", "throughput"}
    assert all(before[m] > 10 for m in before), before
    assert all(after[m] < 0.5 for m in after), after


def test_the_fit_recovers_alpha_and_beta_from_measured_steps(
    setup: tuple[Path, Path, Deployment],
) -> None:
    """Steps priced with alpha 1.3 and beta 0.2 ms (a step CSV) give back alpha and beta."""
    _, _, dep = setup
    truth = Roofline(apply(dep, {"alpha": 1.3, "beta": 2e-4}))
    from inference_lab.calibrate.measurements import StepSample

    steps = tuple(
        StepSample("s.csv", b, p, c, truth.even_price(b, p, c))
        for b, p, c in [(1, 0, 100), (8, 0, 1000), (16, 0, 4000), (1, 999, 500), (4, 2000, 800)]
    )
    result = fit(dep, Measurements(steps=steps), ["alpha", "beta"])
    assert result.fitted["alpha"] == pytest.approx(1.3, rel=1e-4)
    assert result.fitted["beta"] == pytest.approx(2e-4, rel=1e-3)
    assert mape(result.after)["step"] < 1e-3


# ---------------------------------------------------------------------------------------
# the readers


def load_export(**changes: Any) -> dict[str, Any]:
    """An ``inference-lab load -o`` document, as ``client/report.py`` writes it (only the
    keys calibrate reads, with the summary's field names)."""
    doc: dict[str, Any] = {
        "config": {
            "model": "tiny-dense",
            "concurrency": 8,
            "rate": None,
            "prompt_tokens": 50,
            "max_tokens": 200,
        },
        "summary": {
            "mode": "closed",
            "requests": 120,
            "ttft": {"mean": 0.02},
            "tpot": {"mean": 0.004},
            "output_token_throughput": 1500.0,
            "prompt_tokens_mean": 57.0,
            "completion_tokens_mean": 200.0,
        },
    }
    for key, value in changes.items():
        doc[key] = {**doc[key], **value}
    return doc


def test_the_load_reader_uses_the_summary_the_load_client_writes(tmp_path: Path) -> None:
    """The keys read are fields of the load client's ``Summary`` (a rename there fails
    here), and the level is the closed loop at the run's concurrency with the server's
    token counts."""
    fields = attrs.fields_dict(Summary)
    for key in (
        "mode",
        "requests",
        "ttft",
        "tpot",
        "output_token_throughput",
        "prompt_tokens_mean",
        "completion_tokens_mean",
    ):
        assert key in fields
    path = tmp_path / "load.json"
    path.write_text(json.dumps(load_export()))
    (level,) = read_measurements([path], "tiny-dense").levels
    assert (level.kind, level.level, level.prompt_tokens, level.output_tokens) == (
        "closed",
        8,
        57,
        200,
    )
    assert (level.ttft, level.tpot, level.throughput, level.requests) == (0.02, 0.004, 1500.0, 120)
    # the users start spread over one measured request: TTFT + 199 x TPOT
    assert level.start_spread == pytest.approx(0.02 + 199 * 0.004)


def test_the_aiperf_reader_converts_units(tmp_path: Path) -> None:
    """aiperf's ``profile_export_aiperf.json``: metrics in their ``unit``, the load level from
    ``input_config.loadgen``."""
    doc = {
        "time_to_first_token": {"unit": "ms", "avg": 35.0, "p50": 30.0},
        "inter_token_latency": {"unit": "ms", "avg": 6.5},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 4200.0},
        "input_sequence_length": {"unit": "tokens", "avg": 1000.4},
        "output_sequence_length": {"unit": "tokens", "avg": 199.6},
        "request_count": {"unit": "requests", "avg": 640},
        "input_config": {
            "loadgen": {"concurrency": 32},
            "endpoint": {"model_names": ["tiny-dense"]},
        },
    }
    path = tmp_path / "profile_export_aiperf.json"
    path.write_text(json.dumps(doc))
    (level,) = read_measurements([path], "tiny-dense").levels
    assert (level.kind, level.level, level.prompt_tokens, level.output_tokens) == (
        "closed",
        32,
        1000,
        200,
    )
    assert level.ttft == pytest.approx(0.035) and level.tpot == pytest.approx(0.0065)
    assert (level.throughput, level.requests) == (4200.0, 640)


def guidellm_benchmark(strategy: dict[str, Any]) -> dict[str, Any]:
    def dist(mean: float) -> dict[str, Any]:
        return {"successful": {"mean": mean, "count": 50}}

    return {
        "args": {"strategy": strategy},
        "metrics": {
            "prompt_token_count": dist(512.0),
            "output_token_count": dist(128.0),
            "time_to_first_token_ms": dist(40.0),
            "time_per_output_token_ms": dist(8.0),
            "output_tokens_per_second": dist(900.0),
            "request_latency": dist(1.1),
        },
    }


def test_the_guidellm_reader_gives_one_level_per_benchmark(tmp_path: Path) -> None:
    """guidellm's ``benchmarks.json``: synchronous is concurrency 1, concurrent its streams,
    constant and poisson their rate; milliseconds become seconds."""
    strategies = [
        {"type_": "synchronous"},
        {"type_": "concurrent", "streams": 16},
        {"type_": "poisson", "rate": 5.5},
    ]
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps({"benchmarks": [guidellm_benchmark(s) for s in strategies]}))
    levels = read_measurements([path]).levels
    assert [(lv.kind, lv.level) for lv in levels] == [("closed", 1), ("closed", 16), ("open", 5.5)]
    assert levels[1].ttft == pytest.approx(0.04) and levels[1].tpot == pytest.approx(0.008)
    assert (levels[1].prompt_tokens, levels[1].output_tokens, levels[1].requests) == (512, 128, 50)
    assert levels[1].start_spread == pytest.approx(0.04 + 127 * 0.008)
    assert levels[2].start_spread == 0  # an open loop's arrivals are its own


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "m.json: no such file"),
        ('{\n  "summary": ,\n}', "m.json:2: invalid JSON: Expecting value"),
        ('{"hello": 1}', "m.json: not an inference-lab load, aiperf"),
        (
            json.dumps(load_export(summary={"mode": "adaptive"})),
            "m.json: summary.mode: an 'adaptive' run has no fixed load level",
        ),
        (
            json.dumps(load_export(config={"model": "other"})),
            "m.json: config.model: measured model 'other' is not the config's model 'tiny-dense'",
        ),
        (
            json.dumps(load_export(summary={"ttft": {"mean": -1}})),
            "m.json: summary.ttft.mean: must be a number > 0, got -1",
        ),
        (
            json.dumps(load_export(config={"concurrency": "8"})),
            "m.json: config.concurrency: must be a number, got '8'",
        ),
        (
            json.dumps({"benchmarks": [guidellm_benchmark({"type_": "throughput"})]}),
            "m.json: benchmarks[0].args.strategy.type_: a 'throughput' benchmark has no fixed load level",
        ),
        (
            json.dumps(
                {"time_to_first_token": {"unit": "ms", "avg": 1}, "input_config": {"loadgen": {}}}
            ),
            "m.json: input_config.loadgen: neither concurrency nor request_rate is set",
        ),
        (
            json.dumps(
                {
                    "time_to_first_token": {"unit": "parsecs", "avg": 1},
                    "input_config": {"loadgen": {"concurrency": 1}},
                    "input_sequence_length": {"avg": 1},
                    "output_sequence_length": {"avg": 1},
                }
            ),
            "m.json: time_to_first_token.unit: must be a time unit",
        ),
        (
            "batch_size,prefill_tokens,context_tokens,step_seconds\n1,0,5,x\n",
            "m.json:2: step_seconds: must be a number",
        ),
        # bounds a re-simulation can hold (issue 45: 1e7 users held the fit for hours)
        (
            json.dumps(load_export(config={"concurrency": 10_000_000})),
            "m.json: config.concurrency: must be at most 10,000, got 10000000",
        ),
        (
            json.dumps(load_export(config={"concurrency": 1e300})),
            "m.json: config.concurrency: must be at most 10,000, got 1e+300",
        ),
        (
            json.dumps(load_export(config={"concurrency": 10**400})),
            "m.json: config.concurrency: must be at most 10,000, got " + str(10**400)[:37] + "...",
        ),
        (
            json.dumps({"benchmarks": [guidellm_benchmark({"type_": "poisson", "rate": 1e300})]}),
            "m.json: benchmarks[0].args.strategy.rate: must be at most 1e+06, got 1e+300",
        ),
        (
            json.dumps(load_export(summary={"prompt_tokens_mean": 2**63})),
            "m.json: summary.prompt_tokens_mean: must be at most 1e+07",
        ),
        ("[" * 100_000 + "]" * 100_000, "m.json: invalid JSON: nested too deep"),
    ],
)
def test_bad_measurements_are_one_line_naming_file_and_key(
    tmp_path: Path, content: str | None, expected: str
) -> None:
    """Every unreadable or inconsistent measurement file is one line naming it and the key
    (or line)."""
    path = tmp_path / "m.json"
    if content is not None:
        path.write_text(content)
    message = config_error(read_measurements, [path], "tiny-dense")
    assert message.startswith(f"{tmp_path}/{expected}"), message


# ---------------------------------------------------------------------------------------
# the command


def test_calibrate_writes_a_snippet_that_loads_as_a_new_entry(
    setup: tuple[Path, Path, Deployment],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``calibrate`` on a step CSV fits alpha and beta, prints MAPE before and after, and
    writes a ``[hardware.gpu-cal]`` entry; appended to the config it loads beside the
    entry it was fitted from, which is unchanged."""
    path, profiles, dep = setup
    truth = Roofline(apply(dep, {"alpha": 2.0, "beta": 1e-4}))
    rows = [(1, 0, 100), (8, 0, 1000), (16, 0, 3000), (1, 500, 300), (4, 1000, 900)]
    csv = tmp_path / "steps.csv"
    csv.write_text(
        "batch_size,prefill_tokens,context_tokens,step_seconds\n"
        + "".join(f"{b},{p},{c},{truth.even_price(b, p, c)!r}\n" for b, p, c in rows)
    )
    out = tmp_path / "snippet.toml"
    argv = [
        "calibrate",
        "--config",
        str(path),
        "--profiles-dir",
        str(profiles),
        str(csv),
        "--fit",
        "time_correction",
        "--name",
        "gpu-cal",
        "-o",
        str(out),
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "step" in printed and "MAPE before" in printed
    snippet = tomllib.loads(out.read_text())["hardware"]["gpu-cal"]
    assert snippet["profile"] == "gpu" and snippet["tp"] == 1
    assert snippet["time_correction"]["alpha"] == pytest.approx(2.0, rel=1e-4)
    path.write_text(path.read_text() + "\n" + out.read_text())
    deps = load_model_config(path, profiles).deployments
    assert deps["gpu-cal"].hardware.time_correction.alpha == pytest.approx(2.0, rel=1e-4)
    assert deps["gpu"].hardware.time_correction.alpha == 1.0


@pytest.mark.parametrize(
    ("extra", "code", "line"),
    [
        (["missing.json"], 1, "inference-lab calibrate: error: missing.json: no such file"),
        (
            ["--fit", "speed", "x.csv"],
            2,
            "inference-lab calibrate: error: --fit: unknown term 'speed'",
        ),
    ],
)
def test_calibrate_refuses_bad_input_in_one_line(
    setup: tuple[Path, Path, Deployment],
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    code: int,
    line: str,
) -> None:
    """A missing measurement file is exit 1, a bad ``--fit`` exit 2; one line each."""
    path, profiles, _ = setup
    argv = ["calibrate", "--config", str(path), "--profiles-dir", str(profiles), *extra]
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def test_config_error_helper_is_used_for_the_readers(setup: tuple[Path, Path, Deployment]) -> None:
    """The readers raise the config loader's error class (the CLIs' one-line policy)."""
    path, _, _ = setup
    assert "no such file" in config_error(read_measurements, [path.parent / "nope.json"])


def test_levels_are_resimulated_at_their_own_size() -> None:
    """A batch is simulated whole; a closed loop with the measured count (at least 32 and
    4 per user, at most the cap unless 4 per user need more); an open loop with a minute
    of arrivals or the measured count, within 100 and the cap."""
    from inference_lab.calibrate.fit import sim_requests

    def level(kind: str, value: float, requests: int | None = None) -> LoadLevel:
        return LoadLevel(
            source="s", kind=kind, level=value, prompt_tokens=1, output_tokens=1, requests=requests
        )

    assert sim_requests(level("batched", 30000), 1000) == 30000
    assert sim_requests(level("closed", 1), 1000) == 32
    assert sim_requests(level("closed", 16, requests=640), 1000) == 640
    assert sim_requests(level("closed", 16, requests=5000), 1000) == 1000
    assert sim_requests(level("closed", 500), 1000) == 2000
    assert sim_requests(level("open", 0.5), 1000) == 100
    assert sim_requests(level("open", 5.0), 1000) == 300
    assert sim_requests(level("open", 50.0), 1000) == 1000


def test_desynchronised_loops_are_fitted_with_coarse_differences_first(
    setup: tuple[Path, Path, Deployment],
) -> None:
    """A closed loop whose users start spread out gets a coarse pass (0.02) before the fine
    one (0.003); steps, batches and lock-step loops get the fine pass alone."""
    from inference_lab.calibrate.fit import difference_steps

    _, _, dep = setup
    plain = LoadLevel(source="s", kind="closed", level=4, prompt_tokens=10, output_tokens=10)
    spread = attrs.evolve(plain, start_spread=1.5)
    assert difference_steps([(dep, Measurements(levels=(plain,)))]) == (0.003,)
    assert difference_steps([(dep, Measurements(levels=(plain, spread)))]) == (0.02, 0.003)


# ---------------------------------------------------------------------------------------
# what calibrate refuses to recommend


def _step_csv(path: Path, truth: Roofline, rows: list[tuple[int, int, int, float]]) -> Path:
    """A step CSV whose rows are ``truth``'s price of (batch, prefill, context) x factor."""
    path.write_text(
        "batch_size,prefill_tokens,context_tokens,step_seconds\n"
        + "".join(f"{b},{p},{c},{truth.even_price(b, p, c) * k!r}\n" for b, p, c, k in rows)
    )
    return path


@pytest.mark.parametrize(
    ("rows", "fit_terms", "fragment"),
    [
        ([(8, 0, 1000, 1.3)], "efficiency", "1 distinct step(s) in 1 row(s) cannot determine 3"),
        ([(8, 0, 1000, 1.3)] * 4, "time_correction", "1 distinct step(s) in 4 row(s) cannot"),
    ],
)
def test_an_underdetermined_step_table_is_refused_not_fitted_to_a_bound(
    setup: tuple[Path, Path, Deployment],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rows: list[tuple[int, int, int, float]],
    fit_terms: str,
    fragment: str,
) -> None:
    """Rule 4: one row, or identical rows, cannot determine several terms: one line saying
    so, exit 1, and no entry (it used to print one pinned at a bound, memory_bandwidth =
    0.05). The same single row determines one term."""
    path, profiles, dep = setup
    csv = _step_csv(tmp_path / "steps.csv", Roofline(dep), rows)
    base = ["calibrate", "--config", str(path), "--profiles-dir", str(profiles), str(csv)]
    assert cli.main([*base, "--fit", fit_terms]) == 1
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("inference-lab calibrate: error: ") and fragment in line
    assert "under-determined" in line and "[hardware." not in captured.out
    assert cli.main([*base, "--fit", "alpha"]) == 0
    out = capsys.readouterr().out
    assert "alpha = 1.3" in out or "alpha 1.3" in out


def test_an_entry_worse_on_a_metric_needs_force(
    setup: tuple[Path, Path, Deployment], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule 5: steps measured at 1x and 10x the model's price: the least-squares alpha
    (~3.2) is worse in MAPE than 1.0 (45% -> ~142%). The table shows before, after and
    the change; without --force the entry is refused (one line naming the metric, exit
    1), with it printed beside a warning."""
    path, profiles, dep = setup
    rows = [(1, 0, 100, 1.0), (16, 0, 3000, 10.0)]
    csv = _step_csv(tmp_path / "steps.csv", Roofline(dep), rows)
    argv = ["calibrate", "--config", str(path), "--profiles-dir", str(profiles), str(csv)]
    argv += ["--fit", "alpha"]
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    table = [line for line in captured.out.splitlines() if line.startswith("step")]
    assert len(table) == 1 and table[0].endswith("points, worse") and "45.0%" in table[0]
    (line,) = captured.err.splitlines()
    assert line.startswith(
        "inference-lab calibrate: error: the fitted entry is worse than gpu on step 45.0% -> "
    )
    assert line.endswith("not recommending it (--force prints it anyway)")
    assert "[hardware." not in captured.out
    assert cli.main([*argv, "--force"]) == 0
    captured = capsys.readouterr()
    assert "[hardware.gpu-calibrated]" in captured.out
    assert "warning: worse on step 45.0% -> " in captured.err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (json.dumps(load_export(config={"concurrency": 1e300})), "config.concurrency: must be"),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deep"),
    ],
)
def test_calibrate_exits_1_in_one_line_on_inputs_it_cannot_hold(
    setup: tuple[Path, Path, Deployment],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    fragment: str,
) -> None:
    """``calibrate`` on a concurrency of 1e300 or JSON nested 100,000 deep: one line, exit
    1 (a traceback or hours of re-simulation before)."""
    path, profiles, _ = setup
    measured = tmp_path / "m.json"
    measured.write_text(content)
    argv = ["calibrate", "--config", str(path), "--profiles-dir", str(profiles), str(measured)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"inference-lab calibrate: error: {measured}: {fragment}"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize(("name", "value"), [("expert_skew", 1.25), ("layer_overhead", 3e-5)])
def test_a_fitted_optional_efficiency_term_is_in_the_snippet(
    setup: tuple[Path, Path, Deployment], name: str, value: float
) -> None:
    """``--fit`` naming ``expert_skew`` or ``layer_overhead``: the snippet's ``efficiency``
    carries the fitted value beside the entry's other efficiency terms, and loads as the
    entry's."""
    from inference_lab.calibrate.cli import snippet
    from inference_lab.calibrate.fit import FitResult, Prediction

    path, profiles, dep = setup
    config = load_model_config(path, profiles)
    same = Prediction({"ttft": [(1.0, 1.0)]})
    result = FitResult(
        names=(name,), initial=(0.0,), values=(value,), before=same, after=same,
        evaluations=1, iterations=1,
    )  # fmt: skip
    text = snippet(config, dep, result, "gpu-cal", ["m.json"])
    entry = tomllib.loads(text)["hardware"]["gpu-cal"]
    assert entry["efficiency"] == {
        "memory_bandwidth": 1.0, "flops": 1.0, "step_overhead": 0.0, name: value,
    }  # fmt: skip
    path.write_text(path.read_text() + "\n" + text)
    loaded = load_model_config(path, profiles).deployments["gpu-cal"]
    assert getattr(loaded.efficiency, name) == value
