"""Measured step tables: the CSV's columns and errors, multilinear interpolation inside
the table's box, roofline scaling outside it, and the engine priced by a table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference_lab.core.config import Deployment, load_model_config
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.core.roofline import Roofline
from inference_lab.core.step_table import parse_step_table
from inference_lab.errors import ConfigError
from tests.configs_util import config_error, dense_config, write_setup

#: batch {1, 9} x prefill {0} x context {100, 300}, in ms: 1, 2 / 3, 5
DECODE_TABLE = """\
# a decode sweep (comment lines and blank lines are skipped)
batch_size,prefill_tokens,context_tokens,step_seconds
1,0,100,0.001
1,0,300,0.002

9,0,100,0.003
9,0,300,0.005
"""


def ints(values: list[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.array(values, dtype=np.int64)


def with_table(tmp_path: Path, text: str = DECODE_TABLE) -> Deployment:
    (tmp_path / "steps.csv").write_text(text)
    config = dense_config(hardware={"gpu": {"step_table": "steps.csv"}})
    path, profiles = write_setup(tmp_path, config)
    return load_model_config(path, profiles).deployments["gpu"]


def even_decode_seconds(batch: int, context: float) -> float:
    """The dense test model's decode price on the test GPU (memory-bound at 1 TB/s):
    2e9 weight bytes + 4 layers x 512 B per position x context x batch."""
    return (2e9 + 4 * 512 * context * batch) / 1e12


# ---------------------------------------------------------------------------------------
# interpolation and extrapolation against hand values


def test_a_grid_point_costs_its_measurement_exactly(tmp_path: Path) -> None:
    """Nine decodes at c = 299 (context 300 each) cost the measured 5 ms."""
    rf = Roofline(with_table(tmp_path))
    assert rf.step_time(ints([1] * 9), ints([299] * 9)) == 0.005
    assert rf.step_time(ints([1]), ints([99])) == 0.001


def test_inside_the_box_the_time_is_multilinear(tmp_path: Path) -> None:
    """Five decodes at context 200: halfway on both axes, (1 + 2 + 3 + 5) / 4 = 2.75 ms;
    three at context 150: batch weight 1/4, context weight 1/4, (3/4)(3/4)·1 + (3/4)(1/4)·2
    + (1/4)(3/4)·3 + (1/4)(1/4)·5 =
    0.5625 + 0.375 + 0.5625 + 0.3125 = 1.8125 ms."""
    rf = Roofline(with_table(tmp_path))
    assert rf.step_time(ints([1] * 5), ints([199] * 5)) == pytest.approx(2.75e-3, rel=1e-12)
    assert rf.step_time(ints([1] * 3), ints([149] * 3)) == pytest.approx(1.8125e-3, rel=1e-12)
    # mixed contexts: only their mean (here 200) enters
    terms = rf.batch_terms([1] * 5, [99, 149, 199, 249, 299])
    assert rf.price(terms).seconds == pytest.approx(2.75e-3, rel=1e-12)


def test_outside_the_box_the_nearest_measurement_is_roofline_scaled(tmp_path: Path) -> None:
    """Eighteen decodes at context 200 lie past batch 9: the time at (9, 0, 200), 4 ms, times
    the roofline's ratio of 18 to 9 decodes at context 200; a context of 600 past 300 at
    batch 1: 2 ms times the ratio of context 600 to 300."""
    rf = Roofline(with_table(tmp_path))
    wide = rf.step_time(ints([1] * 18), ints([199] * 18))
    assert wide == pytest.approx(
        4e-3 * even_decode_seconds(18, 200) / even_decode_seconds(9, 200), rel=1e-12
    )
    long = rf.step_time(ints([1]), ints([599]))
    assert long == pytest.approx(
        2e-3 * even_decode_seconds(1, 600) / even_decode_seconds(1, 300), rel=1e-12
    )


def test_a_prefill_outside_a_decode_table_is_scaled_from_its_decode_point(tmp_path: Path) -> None:
    """One 401-token prefill from scratch (prefill_tokens 400, context 201) is outside a
    decode-only table: the measurement at (1, 0, 201) times the ratio of the even prices,
    which the roofline gives as ``even_price``."""
    rf = Roofline(with_table(tmp_path))
    at_edge = 1e-3 + (201 - 100) / 200 * 1e-3
    expected = at_edge * rf.even_price(1, 400, 201) / rf.even_price(1, 0, 201)
    assert rf.step_time(ints([401]), ints([0])) == pytest.approx(expected, rel=1e-12)
    # the even price of a compute-light prefill is its memory time (hand value)
    assert rf.even_price(1, 0, 201) == pytest.approx(even_decode_seconds(1, 201), rel=1e-12)


def test_the_engine_prices_its_steps_from_the_table(tmp_path: Path) -> None:
    """One request with a one-token prompt: its steps attend 1, 2, 3 positions; a table
    over batch 1, context 1…1001 of 1 ms and 2 ms makes them 1, 1.001, 1.002 ms."""
    table = "context_tokens,step_seconds,batch_size,prefill_tokens\n1,0.001,1,0\n1001,0.002,1,0\n"
    engine = Engine(with_table(tmp_path, table))
    engine.submit(RequestSpec(prompt_tokens=1, max_tokens=3))
    durations = []
    while engine.next_event_time() is not None:
        ev = engine.step()
        if ev.step is not None:
            durations.append(ev.step.duration)
    assert durations == pytest.approx([1e-3, 1.001e-3, 1.002e-3], rel=1e-12)


def test_the_table_is_read_relative_to_the_config(tmp_path: Path) -> None:
    """``step_table`` is resolved against the config file's directory; the deployment holds
    the parsed table and the entry the resolved path."""
    dep = with_table(tmp_path)
    assert dep.step_table is not None
    assert dep.hardware.step_table == str(tmp_path / "steps.csv")
    assert dep.step_table.batch == (1.0, 9.0)
    assert dep.step_table.context == (100.0, 300.0)


# ---------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "t.csv: empty step table"),
        ("batch_size,prefill_tokens,context_tokens\n", "t.csv:1: the header must name"),
        ("batch_size,prefill_tokens,context_tokens,step_seconds\n", "t.csv: no rows"),
        (
            "batch_size,prefill_tokens,context_tokens,step_seconds\n1.5,0,1,0.1\n",
            "t.csv:2: batch_size: must be an integer, got '1.5'",
        ),
        (
            "batch_size,prefill_tokens,context_tokens,step_seconds\n1,0,1,0\n",
            "t.csv:2: step_seconds: must be > 0, got '0'",
        ),
        (
            "batch_size,prefill_tokens,context_tokens,step_seconds\n1,0,1,nan\n",
            "t.csv:2: step_seconds: must be > 0, got 'nan'",
        ),
        (
            "batch_size,prefill_tokens,context_tokens,step_seconds\n1,-1,1,0.1\n",
            "t.csv:2: prefill_tokens: must be >= 0, got '-1'",
        ),
        (
            "batch_size,prefill_tokens,context_tokens,step_seconds\n1,0,1\n",
            "t.csv:2: expected 4 cells, got 3",
        ),
        (
            "batch_size,prefill_tokens,context_tokens,step_seconds\n1,0,1,0.1\n1,0,1,0.2\n",
            "t.csv:3: batch_size 1, prefill_tokens 0, context_tokens 1 is already on line 2",
        ),
        (
            "batch_size,prefill_tokens,context_tokens,step_seconds\n1,0,1,0.1\n2,0,5,0.2\n",
            "t.csv: not a full grid: no row for batch_size 1, prefill_tokens 0, context_tokens 5",
        ),
    ],
)
def test_bad_tables_are_one_line_naming_file_and_line(text: str, expected: str) -> None:
    """Every problem in a step table is one line naming the file (and line)."""
    message = config_error(parse_step_table, text, "t.csv")
    assert message.startswith(expected), message


def test_a_missing_table_names_the_key(tmp_path: Path) -> None:
    """A ``step_table`` that does not exist is the config's error, naming the key."""
    config = dense_config(hardware={"gpu": {"step_table": "nope.csv"}})
    path, profiles = write_setup(tmp_path, config)
    message = config_error(load_model_config, path, profiles)
    assert "hardware.gpu.step_table: no such file" in message


def test_a_bad_table_fails_the_config_load(tmp_path: Path) -> None:
    """The loader reads the table when it loads the config (never the engine)."""
    with pytest.raises(ConfigError, match=r"steps.csv:3: step_seconds"):
        with_table(
            tmp_path, "batch_size,prefill_tokens,context_tokens,step_seconds\n1,0,1,1\n1,0,2,x\n"
        )
