"""``scripts/fidelity.py``: the shipped measurements load, each names its source, and each
becomes a case its config can serve with plausible units; every calibrated entry can be
measured out of sample; trtllm-bench's engine limits are reproduced by hand; bad rows are
one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import attrs
import fidelity

from inference_lab.core.config import load_deployment, load_hardware_profile
from tests.configs_util import CONFIGS, PROFILES, config_error


def test_the_shipped_measurements_load_with_sources_and_become_cases() -> None:
    """Every row of docs/fidelity/measurements.csv has a source, a table, a row and a
    measured figure; every row is a case on its calibrated entry that passes the unit
    check (fidelity.entry_cases runs inference_lab.calibrate.table.check_units)."""
    rows = fidelity.read_rows()
    assert len(rows) == 113
    for row in rows:
        assert row["source"] and row["table"] and row["row"]
        assert row.measured()
    groups = fidelity.entry_cases(rows)
    assert sum(len(cases) for cases in groups.values()) == len(rows)
    for entry in groups:
        assert fidelity.engine_tag(entry) in fidelity.TERMS
        load_hardware_profile(PROFILES / f"{entry}.toml")


def test_every_entry_is_measured_out_of_sample() -> None:
    """An entry with test rows keeps its split; the others are held out by model (two
    models or more) or by load range (one model at several concurrencies): none is left
    without an out-of-sample measure."""
    groups = fidelity.entry_cases(fidelity.read_rows())
    kinds = {entry: fidelity.holdout_kind(cases) for entry, cases in groups.items()}
    assert kinds["h100-vllm"] == kinds["h200-vllm"] == "model"
    assert kinds["h200-sglang"] == kinds["mi300x-sglang"] == kinds["b200-vllm"] == "concurrency"
    assert kinds["h100-trtllm"] == kinds["h100-nim"] == "split"
    assert "none" not in kinds.values()


def case(model: str, split: str = "fit", level: int = 8) -> SimpleNamespace:
    return SimpleNamespace(
        row={"model_config": model, "split": split},
        level=SimpleNamespace(kind="closed", level=level),
    )


def test_how_an_entry_is_held_out_by_hand() -> None:
    """A test row of a model the fit rows have makes a split; a test row of a model no fit
    row has is out of sample as it stands and leaves the hold-out to the fit rows: by
    model where they cover two, by load range where one model has two levels."""
    kind = fidelity.holdout_kind
    assert kind([case("a"), case("b"), case("c", "test")]) == "model"
    assert kind([case("a"), case("b"), case("a", "test")]) == "split"
    assert kind([case("a", level=8), case("a", level=64), case("c", "test")]) == "concurrency"
    assert kind([case("a"), case("c", "test")]) == "split"
    assert kind([case("a")]) == "none"


def test_the_inheriting_entries_carry_their_donors_host_terms() -> None:
    """h200-vllm and b200-vllm take the host's terms from h100-vllm (fidelity.INHERITS):
    the shipped profiles hold the donor's values, so a refit of the donor that is not
    carried over fails here."""
    for entry, (donor, names) in fidelity.INHERITS.items():
        assert donor == "h100-vllm" and names == fidelity.HOST_TERMS
        values = fidelity.inherited(entry)
        assert set(values) == set(names) and values["layer_overhead"] > 0
        profile = load_hardware_profile(PROFILES / f"{entry}.toml")
        shipped = {**attrs.asdict(profile.efficiency), **attrs.asdict(profile.overheads)}
        assert {n: shipped[n] for n in names} == values


def test_hopper_runs_mxfp4_weights_at_the_bf16_rate_in_the_vllm_profiles() -> None:
    """The vLLM profiles of Hopper GPUs price FP4 weights at the BF16 rate (dequantised
    kernels); the datasheet profiles keep the FP8 rate (their figures unchanged)."""
    for gpu in ("h100", "h200"):
        vllm = load_hardware_profile(PROFILES / f"{gpu}-vllm.toml")
        assert vllm.flops("fp4") == vllm.flops("bf16") == 9.89e14
        assert load_hardware_profile(PROFILES / f"{gpu}.toml").flops("fp4") == 1.979e15


def test_trtllm_bench_limits_by_hand() -> None:
    """Llama-3.1-8B FP8 on one H100 at 128/128: (80e9 − 8.03e9 B) / 2^30 = 67.03 GiB
    free, x 0.95 / (64 KiB per token x 256 tokens) = 4,075 requests -> batch 256 x
    ceil(4075 / 256) = 4,096, tokens 512 x ceil(8,150 / 512) = 8,192. Llama-3.3-70B FP8
    on one H200 at 20000/2000: 18.6 requests -> the minimum batch 64; 205 tokens -> the
    minimum 2,048."""
    small = load_deployment(
        CONFIGS / "fidelity" / "Llama-3.1-8B-Instruct-FP8.toml", "h100", PROFILES
    )
    assert fidelity.trtllm_bench_limits(small, 128, 128) == (4096, 8192)
    big = load_deployment(
        CONFIGS / "fidelity" / "Llama-3.3-70B-Instruct-FP8.toml", "h200", PROFILES
    )
    assert fidelity.trtllm_bench_limits(big, 20000, 2000) == (64, 2048)


def test_a_bad_row_is_one_line_naming_the_file_and_line(tmp_path: Path) -> None:
    """A row whose split is neither fit nor test, or whose figure is not a positive
    number, is refused naming the line."""
    text = fidelity.DATA.read_text().splitlines()
    bad = tmp_path / "m.csv"
    bad.write_text("\n".join([text[0], text[1].replace(",fit", ",train")]) + "\n")
    assert config_error(fidelity.read_rows, bad).endswith("m.csv:2: split: must be fit or test")
    cells = text[1].split(",")
    cells[text[0].split(",").index("output_tps")] = "-5"
    bad.write_text("\n".join([text[0], ",".join(cells)]) + "\n")
    assert config_error(fidelity.read_rows, bad).endswith(
        "m.csv:2: output_tps: must be > 0, got '-5'"
    )
