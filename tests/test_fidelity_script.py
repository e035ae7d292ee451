"""``scripts/fidelity.py``: the shipped measurements load and each names its source and
split; trtllm-bench's engine limits are reproduced by hand; bad rows are one line."""

from __future__ import annotations

from pathlib import Path

import fidelity

from inference_lab.core.config import load_deployment
from tests.configs_util import CONFIGS, PROFILES, config_error


def test_the_shipped_measurements_load_with_sources_and_a_split() -> None:
    """Every row of docs/fidelity/measurements.csv has a source, a table, a row, a measured
    figure and a split; each source table has fit and test rows."""
    rows = fidelity.read_rows()
    assert len(rows) == 59
    for row in rows:
        assert row["source"] and row["table"] and row["row"]
        assert row.number("output_tps") is not None
    tables = {row["table"] + row["column"] for row in rows}
    for table in tables:
        splits = {row["split"] for row in rows if row["table"] + row["column"] == table}
        assert "test" in splits


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
    cells[14] = "-5"
    bad.write_text("\n".join([text[0], ",".join(cells)]) + "\n")
    assert config_error(fidelity.read_rows, bad).endswith(
        "m.csv:2: output_tps: must be > 0, got '-5'"
    )
