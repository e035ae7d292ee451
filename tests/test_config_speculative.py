"""``[speculative]`` in a model config: what loads, the acceptance models, a CSV of measured
rounds read by the loader, and one-line errors naming the file and key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference_lab.core.config import load_model_config
from tests.configs_util import attention, config_error, dense_config, write_setup


def config(**speculative: Any) -> dict[str, Any]:
    base = dense_config()
    base["speculative"] = {
        "num_speculative_tokens": 3,
        "drafter": {"kind": "fraction", "fraction": 0.05},
        **speculative,
    }
    return base


def load(tmp_path: Path, cfg: dict[str, Any]) -> Any:
    path, profiles = write_setup(tmp_path, cfg)
    return load_model_config(path, profiles)


def error(tmp_path: Path, cfg: dict[str, Any]) -> tuple[Path, str]:
    path, profiles = write_setup(tmp_path, cfg)
    return path, config_error(load_model_config, path, profiles)


def test_a_constant_rate_gives_alpha_to_the_j(tmp_path: Path) -> None:
    cfg = load(tmp_path, config(acceptance_rate=0.5))
    assert cfg.acceptance_rates == (0.5, 0.25, 0.125)
    dep = cfg.deployments["gpu"]
    assert dep.speculative is cfg.speculative and dep.acceptance_rates == (0.5, 0.25, 0.125)


def test_per_position_rates_are_taken_as_given(tmp_path: Path) -> None:
    cfg = load(tmp_path, config(acceptance_rates=[0.8, 0.6, 0.6]))
    assert cfg.acceptance_rates == (0.8, 0.6, 0.6)


def test_a_csv_of_measured_rounds_becomes_per_position_rates(tmp_path: Path) -> None:
    """Rounds 3, 0, 1, 3 (header skipped, extra cells ignored): at least 1 accepted in 3
    of 4, at least 2 in 2, 3 in 2."""
    (tmp_path / "rounds.csv").write_text("accepted,step\n3,1\n0,2\n1,3\n3,4\n")
    cfg = load(tmp_path, config(acceptance_file="rounds.csv"))
    assert cfg.acceptance_rates == (0.75, 0.5, 0.5)
    assert cfg.speculative.acceptance_file == str(tmp_path / "rounds.csv")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("accepted\n1\nx\n", ":3: must be an accepted draft count (an integer), got 'x'"),
        ("4\n", ":1: accepted count must be in 0..3 (num_speculative_tokens), got 4"),
        ("accepted\n", ": no acceptance rounds"),
    ],
)
def test_a_bad_csv_names_the_file_and_line(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "rounds.csv").write_text(text)
    _, message = error(tmp_path, config(acceptance_file="rounds.csv"))
    assert message.startswith(str(tmp_path / "rounds.csv")), message
    assert fragment in message, message


def test_a_missing_csv_names_the_key(tmp_path: Path) -> None:
    path, message = error(tmp_path, config(acceptance_file="nope.csv"))
    assert message.startswith(f"{path}: speculative.acceptance_file: no such file"), message


@pytest.mark.parametrize(
    ("changes", "key", "fragment"),
    [
        ({}, "speculative.acceptance_rate", "set exactly one of"),
        (
            {"acceptance_rate": 0.7, "acceptance_rates": [0.7, 0.5, 0.3]},
            "speculative.acceptance_rate",
            "got acceptance_rate, acceptance_rates",
        ),
        ({"acceptance_rate": 1.5}, "speculative.acceptance_rate", "must be <= 1"),
        ({"acceptance_rates": [0.7, 0.5]}, "speculative.acceptance_rates", "3 entries, got 2"),
        ({"acceptance_rates": [0.5, 0.7, 0.1]}, "speculative.acceptance_rates", "never rise"),
        (
            {"acceptance_rate": 0.7, "num_speculative_tokens": 0},
            "speculative.num_speculative_tokens",
            "must be >= 1",
        ),
        (
            {"acceptance_rate": 0.7, "gamma_by_batch": [[8, 2], [4, 1]]},
            "speculative.gamma_by_batch",
            "seqs must ascend",
        ),
        (
            {"acceptance_rate": 0.7, "gamma_by_batch": [[8, 2], [16, 3]]},
            "speculative.gamma_by_batch",
            "never rising",
        ),
        (
            {"acceptance_rate": 0.7, "drafter": {"kind": "fraction"}},
            "speculative.drafter.fraction",
            "is required when kind = fraction",
        ),
        (
            {"acceptance_rate": 0.7, "drafter": {"kind": "model"}},
            "speculative.drafter.weights",
            "needs at least one weight stream",
        ),
        (
            {"acceptance_rate": 0.7, "drafter": {"kind": "ngram"}},
            "speculative.drafter.kind",
            "must be one of fraction, model, mtp",
        ),
        (
            {
                "acceptance_rate": 0.7,
                "drafter": {
                    "kind": "model",
                    "weights": [
                        {"precision": "bf16", "active_params": 1e8, "resident_params": 1e8}
                    ],
                    "layers": [attention(1, window=128)],
                },
            },
            "speculative.drafter.layers",
            "full-context attention or mla",
        ),
        ({"acceptance_rate": 0.7, "gamma": 3}, "speculative.gamma", "unknown key"),
    ],
)
def test_bad_speculative_tables_name_the_key(
    tmp_path: Path, changes: dict[str, Any], key: str, fragment: str
) -> None:
    cfg = config(**changes)
    path, message = error(tmp_path, cfg)
    assert message.startswith(f"{path}: {key}:"), message
    assert fragment in message, message


def test_gamma_for_follows_the_batch_table(tmp_path: Path) -> None:
    cfg = load(tmp_path, config(acceptance_rate=0.7, gamma_by_batch=[[8, 2], [32, 1], [64, 0]]))
    spec = cfg.speculative
    assert [spec.gamma_for(s) for s in (1, 7, 8, 31, 32, 63, 64, 500)] == [3, 3, 2, 2, 1, 1, 0, 0]


def test_without_the_table_nothing_speculates(tmp_path: Path) -> None:
    cfg = load(tmp_path, dense_config())
    assert cfg.speculative is None and cfg.deployments["gpu"].speculative is None
