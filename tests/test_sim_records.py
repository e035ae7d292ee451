"""The simulator's compact records (:mod:`inference_lab.sim.records`) and its lazy feed of
an open loop change no figure: the run, its summary, its JSON and its request CSV are
those of Python objects held in lists and every arrival submitted up front."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import attrs
import pytest

from inference_lab.core.config import (
    FixedDist,
    LognormalDist,
    Workload,
    load_deployment,
    load_workload,
)
from inference_lab.core.engine import Engine, Finished, RunReport, StepInfo
from inference_lab.sim import intake as run_module
from inference_lab.sim.records import ArrivalTable, FinishedTable, StepTotals
from inference_lab.sim.run import SimResult, run_simulation
from inference_lab.sim.summary import (
    prefix_cache_summary,
    replica_summaries,
    request_latencies,
    speculative_summary,
    summarize,
)
from inference_lab.sim.text import write_request_csv
from inference_lab.workload import Arrival, ArrivalGenerator, OpenLoopGenerator

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
GPT_OSS = CONFIGS / "gpt-oss-20b.toml"
LLAMA = CONFIGS / "Llama-3-70B.toml"


def _finished(i: int) -> Finished:
    """A varied record: single-token ones, stops, cached prefixes, two replicas, floats
    that are not round in binary."""
    return Finished(
        request_id=i + 1,
        prompt_tokens=10 + 7 * i,
        output_tokens=1 if i % 4 == 0 else 3 + i,
        finish_reason="stop" if i % 3 == 0 else "length",
        arrival_time=i * 0.1,
        first_scheduled_time=i * 0.1 + 1e-3 / 3,
        first_token_time=i * 0.1 + 0.01 * (i % 5 + 1) / 7,
        finish_time=i * 0.1 + 0.2 + i / 3,
        preemptions=i % 2,
        n=1 + i % 3,
        cached_tokens=64 * (i % 2),
        worker=i % 2,
    )


def _step(i: int) -> StepInfo:
    return StepInfo(
        worker=0,
        start=i * 0.01,
        duration=0.01 + i / 7000,
        num_seqs=1 + i,
        num_tokens=10 + i,
        kv_usage=(i % 11) / 13,
        flop_util=(i % 7) / 9,
        bw_util=(i % 5) / 11,
        preempted=i % 3,
        drafts=i % 4,
        draft_tokens=3 * (i % 4),
        accepted_tokens=i % 5,
        plain_duration=0.02 + i / 9000,
    )


def test_finished_table_gives_back_each_record_bit_for_bit() -> None:
    """Every record read back (by index, negative index, slice, iteration) equals the one
    added; a column is the field of every record in order."""
    records = [_finished(i) for i in range(40)]
    table = FinishedTable()
    table.extend(records[:15])
    table.extend(records[15:])
    assert len(table) == 40
    assert list(table) == records
    assert table[7] == records[7] and table[-1] == records[-1]
    assert table[3:9] == records[3:9]
    with pytest.raises(IndexError):
        table[40]
    assert table.column("finish_time").tolist() == [f.finish_time for f in records]
    assert table.column("worker").tolist() == [f.worker for f in records]


@pytest.mark.parametrize("count", [0, 1, 40])
def test_compact_records_summarise_as_the_objects_do(count: int) -> None:
    """summarize, the prefix-cache, replica and speculative figures and the per-request
    latencies are identical from the compact records and from lists of objects."""
    records = [_finished(i) for i in range(count)]
    steps = [_step(i) for i in range(3 * count)]
    table = FinishedTable()
    table.extend(records)
    totals = StepTotals(speculative=True)
    for s in steps:
        totals.add(s)
    assert summarize(table, totals, refused=2, first_arrival=0.0) == summarize(
        records, steps, refused=2, first_arrival=0.0
    )
    assert speculative_summary(totals) == speculative_summary(steps)

    @attrs.frozen
    class Stats:
        prefix_caching: bool = True
        prefix_cache_queries: int = 100
        prefix_cache_hits: int = 40
        workers: tuple[Any, ...] = (
            attrs.make_class(
                "W",
                {
                    "prefix_cache_queries": attrs.field(default=60),
                    "prefix_cache_hits": attrs.field(default=30),
                },
            )(),
            attrs.make_class(
                "W",
                {
                    "prefix_cache_queries": attrs.field(default=40),
                    "prefix_cache_hits": attrs.field(default=10),
                },
            )(),
        )

    stats = Stats()
    assert prefix_cache_summary(stats, table) == prefix_cache_summary(stats, records)
    assert replica_summaries(stats, table) == replica_summaries(stats, records)
    a, b = request_latencies(table), request_latencies(records)
    for name in ("ttft", "tpot", "e2e", "queue", "output_tokens"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes()


def test_arrival_table_is_a_mapping_of_the_ids_it_was_given() -> None:
    """Ids map to their arrivals' positions (a refused arrival takes no id); `pop`
    removes one; absent ids raise KeyError."""
    import numpy as np

    table = ArrivalTable(
        np.array([0.5, 1.0, 1.5, 2.0]), np.array([10, 20, 30, 40]), np.array([1, 2, 3, 4])
    )
    table.add(1, 0)
    table.add(2, 2)  # the arrival at position 1 was refused
    table.add(3, 3)
    assert table[2] == Arrival(1.5, 30, 3) and table.get(9) is None
    assert list(table) == [1, 2, 3] and len(table) == 3
    assert table.pop(2) == Arrival(1.5, 30, 3)
    assert 2 not in table and 3 in table and list(table) == [1, 3] and len(table) == 2
    with pytest.raises(KeyError):
        table[2]


def _csv(result: SimResult) -> str:
    out = io.StringIO()
    write_request_csv(result, out)
    return out.getvalue()


def _held_csv(result: SimResult) -> str:
    """The request CSV written from a tuple of `Finished` objects (the generic path)."""
    return _csv(attrs.evolve(result, finished=tuple(result.finished)))


def _run(workload: Workload, config: Path = GPT_OSS, **scheduler: Any) -> SimResult:
    dep = load_deployment(config, "b200")
    if scheduler:
        dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, **scheduler))
    return run_simulation(dep, workload)


def _workload(pattern: str, count: int, **extra: Any) -> Workload:
    base = load_workload(CONFIGS / "workloads" / "poisson-50rps-4000.toml")
    rate = 300.0 if pattern != "burst" else None
    return attrs.evolve(
        base, arrival_pattern=pattern, arrival_rate=rate, num_requests=count, **extra
    )


CASES: dict[str, tuple[Workload, Path, dict[str, Any]]] = {
    "poisson": (_workload("poisson", 3000), GPT_OSS, {}),
    "batched": (_workload("batched", 600), GPT_OSS, {}),
    "batched-short": (
        _workload("batched", 400, input_len_dist=FixedDist(value=50)),
        GPT_OSS,
        {},
    ),
    "uniform": (_workload("uniform", 1500), GPT_OSS, {}),
    "burst": (_workload("burst", 300), GPT_OSS, {}),
    "batched-bounded": (_workload("batched", 600), GPT_OSS, {"max_waiting": 40}),
    "poisson-bounded": (_workload("poisson", 3000), GPT_OSS, {"max_waiting": 40}),
    "never-fit": (
        _workload("poisson", 800, input_len_dist=LognormalDist(mean=8.0, std_dev=0.7)),
        LLAMA,
        {},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_lazily_fed_open_loop_runs_as_if_submitted_up_front(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open loop fed to the engine in chunks (Rule 2 of `sim.run`; small chunks here)
    gives the same summary, JSON, capacity verdict, refusals and request CSV as every
    arrival submitted before the first step -- ties at one instant included (batched)."""
    workload, config, scheduler = CASES[case]
    monkeypatch.setattr(run_module, "FEED_CHUNK", 7)
    lazy = _run(workload, config, **scheduler)
    # an open loop that offers no arrays: its arrivals are submitted up front
    monkeypatch.setattr(OpenLoopGenerator, "arrays", ArrivalGenerator.arrays)
    upfront = _run(workload, config, **scheduler)
    assert isinstance(lazy.arrivals, ArrivalTable) and isinstance(upfront.arrivals, dict)
    doc, ref = lazy.to_dict(), upfront.to_dict()
    doc.pop("time"), ref.pop("time")
    assert doc == ref
    assert lazy.refused == upfront.refused
    assert dict(lazy.arrivals) == upfront.arrivals
    assert list(lazy.finished) == list(upfront.finished)
    assert _csv(lazy) == _csv(upfront)
    if case == "never-fit":
        assert any(r.limit == "max_seq_len" for r in lazy.refused)
    if "bounded" in case:
        assert any(r.limit == "max_waiting" for r in lazy.refused)


@pytest.mark.parametrize("case", ["poisson", "batched", "burst", "never-fit", "closed"])
def test_events_taken_in_runs_give_the_run_of_one_event_at_a_time(case: str) -> None:
    """Rule 7 of `sim.run`: the loop that takes events in runs (`Engine.run_until`)
    gives the same summary, JSON (peak queue and capacity verdict included), refusals,
    records and request CSV as the loop that sees every arrival's `StepEvents` (an
    `on_events` callback turns the runs off)."""
    if case == "closed":
        workload, config, scheduler = _closed_loop(), GPT_OSS, {}
    else:
        workload, config, scheduler = CASES[case]
    dep = load_deployment(config, "b200")
    if scheduler:
        dep = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, **scheduler))
    taken: list[int] = []
    take = Engine.run_until

    def counting(engine: Engine, *args: Any, **kw: Any) -> RunReport:
        report = take(engine, *args, **kw)
        taken.append(report.arrivals)
        return report

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "run_until", counting)
        runs = run_simulation(dep, workload)
    assert sum(taken) > len(runs.finished) // 2  # most arrivals were taken in runs
    seen: list[int] = []
    each = run_simulation(dep, workload, on_events=lambda ev: seen.extend(ev.arrived))
    assert len(seen) == len(runs.finished) + sum(
        1 for r in runs.refused if r.limit != "max_seq_len"
    )
    doc, ref = runs.to_dict(), each.to_dict()
    doc.pop("time"), ref.pop("time")
    assert doc == ref
    assert runs.peak_waiting == each.peak_waiting and runs.capacity == each.capacity
    assert runs.refused == each.refused
    assert list(runs.finished) == list(each.finished)
    assert _csv(runs) == _csv(each)


def _closed_loop() -> Workload:
    return attrs.evolve(
        _workload("poisson", 600), arrival_pattern="closed_loop", num_concurrent_users=48
    )


def test_the_request_csv_is_the_one_written_from_held_records() -> None:
    """The CSV written row by row from the compact records is byte for byte the one
    written from a tuple of `Finished` objects, refusals and sessions included."""
    bounded = _run(_workload("poisson", 2000), GPT_OSS, max_waiting=20)
    assert bounded.refused and _csv(bounded) == _held_csv(bounded)
    sessions = load_workload(CONFIGS / "workloads" / "chat-sessions-200.toml")
    result = _run(sessions)
    text = _csv(result)
    assert text == _held_csv(result) and ",0," in text  # session / turn columns
    assert text.count("\n") == 1 + len(result.finished) + len(result.refused)


def test_the_run_keeps_no_object_per_request() -> None:
    """An open loop's result holds compact records: columns, not objects (Rule 7)."""
    result = _run(_workload("poisson", 500))
    assert isinstance(result.finished, FinishedTable)
    assert isinstance(result.arrivals, ArrivalTable)
    assert len(result.finished) == 500 and not math.isnan(result.summary.ttft.p99 or 0.0)
