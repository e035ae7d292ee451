"""``docs/grafana/inference-lab.json``: the Grafana board reads only series the server
exports (vLLM's names, so it works on a vLLM fleet too, and ``inference_lab:*``), every
panel uses the board's data-source variable, and no two panels overlap."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServeFactory, make_settings

BOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "inference-lab.json"
NAME = re.compile(r"\b((?:vllm|inference_lab):[a-z0-9_]+)")


def board() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(BOARD.read_text())
    return doc


def expressions() -> list[str]:
    return [t["expr"] for p in board()["panels"] for t in p.get("targets", [])]


async def test_every_series_the_board_reads_is_exported(serve: ServeFactory) -> None:
    """Each metric name in a query (its _bucket / _total sample names included) is a
    family of /metrics; the board reads vLLM's and ours."""
    async with serve(make_settings()) as s:
        text = (await (await s.client.get("/metrics")).get_data()).decode()
    samples = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }
    used = {name for expr in expressions() for name in NAME.findall(expr)}
    assert used - samples == set()
    assert any(n.startswith("vllm:") for n in used) and any(
        n.startswith("inference_lab:") for n in used
    )
    for family in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "inference_lab:requests_rejected_total",
        "inference_lab:pacing_lag_seconds",
        "inference_lab:max_num_seqs",
        "inference_lab:max_waiting",
    ):
        assert any(family in expr for expr in expressions()), family


def test_panels_use_the_datasource_variable_and_do_not_overlap() -> None:
    doc = board()
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name"} <= names
    panels = doc["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
            for target in p["targets"]:
                assert 'model_name=~"$model_name"' in target["expr"], target["expr"]
    boxes = [p["gridPos"] for p in panels]
    for a, b in itertools.combinations(boxes, 2):
        apart = (
            a["x"] + a["w"] <= b["x"]
            or b["x"] + b["w"] <= a["x"]
            or a["y"] + a["h"] <= b["y"]
            or b["y"] + b["h"] <= a["y"]
        )
        assert apart, (a, b)
