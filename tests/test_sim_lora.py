"""`sim` with LoRA adapters: a workload's ``[adapters]`` spread (Zipf or weights), its own
draws, a session's one adapter, the summary's loads and waits, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from inference_lab import cli
from inference_lab.core.config import (
    AdapterMix,
    LoraAdapter,
    LoraConfig,
    Workload,
    load_workload,
    with_lora,
)
from inference_lab.errors import ConfigError
from inference_lab.executors.backends import InlineExecutor
from inference_lab.sim.fleet import run_fleet
from inference_lab.sim.run import run_simulation
from inference_lab.sim.shard import run_shard
from inference_lab.workload.adapters import AdapterPicker
from inference_lab.workload.arrivals import Arrival
from tests.engine_util import LLAMA8B, ROOT, deployment

QUICK = ROOT / "configs" / "workloads" / "quick.toml"
NAMES = tuple(f"adapter-{i}" for i in range(8))


def lora_deployment(max_loras: int):  # type: ignore[no-untyped-def]
    lora = LoraConfig(max_loras=max_loras, adapters=tuple(LoraAdapter(name=n) for n in NAMES))
    return with_lora(deployment(), lora, "test")


def workload(**mix: object) -> Workload:
    return attrs.evolve(
        load_workload(QUICK),
        num_requests=200,
        arrival_rate=20.0,
        adapters=AdapterMix(**mix),  # type: ignore[arg-type]
    )


def test_zipf_spreads_requests_and_the_summary_counts_loads_and_waits() -> None:
    wl = workload(zipf=1.0)
    two = run_simulation(lora_deployment(2), wl)
    eight = run_simulation(lora_deployment(8), wl)
    assert two.lora is not None and eight.lora is not None
    assert sum(two.lora.requests.values()) == 200
    assert two.lora.requests == eight.lora.requests  # the same draws
    counts = [two.lora.requests.get(n, 0) for n in NAMES]
    assert counts[0] == max(counts)  # the most popular adapter is the first
    assert eight.lora.skips == 0  # 8 adapters always fit 8 slots
    assert eight.lora.loads == 8  # each loaded once, never evicted
    assert two.lora.skips > 0 and two.lora.loads > 8
    assert two.to_dict()["lora"]["loads"] == two.lora.loads
    # with 2 slots requests wait for one: the queue time grows
    assert two.summary.queue.mean > eight.summary.queue.mean


def test_adapters_draw_from_their_own_stream() -> None:
    """adapters Rule 1: the same arrivals, lengths and order with and without."""
    wl = workload(zipf=1.0)
    with_adapters = run_simulation(lora_deployment(8), wl)
    without = run_simulation(lora_deployment(8), attrs.evolve(wl, adapters=None))
    assert without.lora is not None and without.lora.requests == {}
    a = sorted((x.time, x.prompt_tokens, x.output_len) for x in with_adapters.arrivals.values())
    b = sorted((x.time, x.prompt_tokens, x.output_len) for x in without.arrivals.values())
    assert a == b


def test_weights_and_the_base_share() -> None:
    result = run_simulation(
        lora_deployment(2),
        workload(weights={"adapter-3": 3.0, "adapter-5": 1.0}, base_share=0.5),
    )
    assert result.lora is not None
    assert set(result.lora.requests) == {"adapter-3", "adapter-5", "base"}
    assert sum(result.lora.requests.values()) == 200


def test_a_session_or_a_user_keeps_its_adapter() -> None:
    picker = AdapterPicker(AdapterMix(zipf=0.0), NAMES, seed=1)
    for session in range(20):
        first = picker.pick(Arrival(0.0, 10, 10, session=session, turn=0))
        for turn in range(1, 4):
            assert picker.pick(Arrival(0.0, 10, 10, session=session, turn=turn)) == first
    users = {picker.pick(Arrival(0.0, 10, 10, user=u)) for u in range(40)}
    assert len(users) > 1


def test_bad_adapter_workloads_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"adapters.weights.nope: not an adapter"):
        run_simulation(lora_deployment(2), workload(weights={"nope": 1.0}))
    with pytest.raises(ConfigError, match=r"serves no LoRA adapter"):
        run_simulation(deployment(), workload(zipf=1.0))
    with pytest.raises(Exception, match="exactly one of zipf and weights"):
        AdapterMix()
    with pytest.raises(ConfigError, match="LoRA adapters are not sharded"):
        run_fleet(lora_deployment(2), workload(zipf=1.0), InlineExecutor(run_shard), shards=2)


def test_the_sim_command_prints_and_writes_the_lora_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "model.toml"
    adapters = ", ".join(f'{{ name = "{n}" }}' for n in NAMES)
    config.write_text(LLAMA8B.read_text() + f"\n[lora]\nmax_loras = 2\nadapters = [{adapters}]\n")
    wl = tmp_path / "wl.toml"
    wl.write_text(QUICK.read_text() + "\n[adapters]\nzipf = 1.2\n")
    out = tmp_path / "out.json"
    assert cli.main(["sim", "--config", str(config), "--workload", str(wl), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "LoRA         " in text and "adapter loads" in text
    data = json.loads(out.read_text())
    assert sum(data["lora"]["requests"].values()) == 50
    bad = tmp_path / "bad.toml"
    bad.write_text(QUICK.read_text() + "\n[adapters]\nzipf = 1.0\nweights = { a = 1.0 }\n")
    assert cli.main(["sim", "--config", str(config), "--workload", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "adapters" in err and "exactly one of zipf and weights" in err
    assert len(err.strip().splitlines()) == 1
