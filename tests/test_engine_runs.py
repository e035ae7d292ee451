"""``Engine.run_until`` (the event loop's Rule 2) is ``step()`` one event at a time, to the
bit: the same steps with the same figures, the same completions, the same state.

Each scenario drives two engines through the same random workload and the same
disturbances (aborts, late submissions) at the same times: one event by event with
``step()``, the other in ``run_until`` calls to random cutoffs (some stopping at a
completion or before an arrival), and compares every step's figures (as the simulator's
``StepTotals`` keeps them), every ``Finished`` record and the engines' statistics. The
scenarios cover decode runs (windowed and full attention, loaded and light), preemption,
prefix hits, groups (``n > 1``), speculative decoding, MLA on data-parallel ranks,
replicas behind a cache-aware router, a small token budget, the frontend latency and
prefill/decode disaggregation (hand-offs, transfers, held blocks, back-pressure) and KV
tiers behind HBM (spills, fetches).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from inference_lab.core.config import Deployment, load_deployment, split_pd
from inference_lab.core.engine import Engine, Finished, RequestSpec
from inference_lab.core.engine import fast_path as fast_module
from inference_lab.sim.records import FinishedTable, StepTotals
from tests.engine_util import DEEPSEEK_V3, GPT_OSS_20B, LLAMA8B, ROOT, deployment

EAGLE = ROOT / "configs" / "frontier" / "Llama-3.1-8B-Instruct-EAGLE.toml"


def _specs(count: int, seed: int, rate: float, **kw: Any) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, count))
    prompts = np.maximum(rng.lognormal(kw.get("prompt_mu", 5.5), 0.8, count), 1).astype(int)
    outputs = np.maximum(rng.lognormal(kw.get("output_mu", 4.8), 0.8, count), 1).astype(int)
    out = []
    for i in range(count):
        n = int(rng.integers(2, 4)) if kw.get("groups") and i % 7 == 3 else 1
        chain: tuple[int, ...] = ()
        if kw.get("hashes") and i % 3 == 0:
            chain = tuple(range(1000 * (i % 5), 1000 * (i % 5) + int(prompts[i]) // 16))
        target = int(outputs[i]) if i % 5 else max(1, int(outputs[i]) // 2)
        out.append(
            RequestSpec(
                prompt_tokens=int(prompts[i]),
                max_tokens=int(outputs[i]),
                target=target,
                arrival_time=float(times[i]),
                n=n,
                block_hashes=chain,
            )
        )
    return out


SCENARIOS: dict[str, Callable[[], tuple[Deployment, dict[str, Any]]]] = {
    "gpt-oss-light": lambda: (
        deployment(GPT_OSS_20B),
        {"rate": 60.0, "prompt_mu": 6.9, "output_mu": 5.3},
    ),
    "gpt-oss-loaded": lambda: (deployment(GPT_OSS_20B), {"rate": 300.0}),
    "llama-full-attention": lambda: (deployment(LLAMA8B), {"rate": 80.0}),
    "preemptions": lambda: (deployment(LLAMA8B, blocks=300), {"rate": 200.0}),
    "prefix-hits": lambda: (deployment(LLAMA8B), {"rate": 150.0, "hashes": True}),
    "groups": lambda: (deployment(LLAMA8B), {"rate": 150.0, "groups": True}),
    "speculative": lambda: (load_deployment(EAGLE, "h100"), {"rate": 60.0}),
    "mla-dp-ranks": lambda: (load_deployment(DEEPSEEK_V3, "h200"), {"rate": 150.0}),
    "kv-aware-replicas": lambda: (
        deployment(LLAMA8B, replicas=2, router="kv_aware"),
        {"rate": 300.0, "hashes": True},
    ),
    "small-budget": lambda: (
        deployment(GPT_OSS_20B, max_num_batched_tokens=512, long_prefill_token_threshold=128),
        {"rate": 120.0},
    ),
    "runs-into-preemption": lambda: (
        deployment(GPT_OSS_20B, blocks=700),
        {"rate": 60.0, "prompt_mu": 6.9, "output_mu": 5.3},
    ),
    "round-robin-replicas": lambda: (deployment(LLAMA8B, replicas=2), {"rate": 160.0}),
    "disaggregated-2p1d": lambda: (
        split_pd(deployment(LLAMA8B, replicas=1), 2, 1),
        {"rate": 120.0, "hashes": True},
    ),
    "disaggregated-tight-decode": lambda: (
        _pd_tight(),
        {"rate": 150.0},
    ),
    "kv-tiers": lambda: (
        deployment(
            LLAMA8B,
            "h100",
            blocks=600,
            kv_offloading_size=0.25,
            kv_offloading_disk_size=1.0,
            kv_offloading_disk_bandwidth=2e9,
        ),
        {"rate": 150.0, "hashes": True},
    ),
    "frontend-latency": lambda: (deployment(LLAMA8B, frontend_latency=0.002), {"rate": 80.0}),
}

Outcome = tuple[StepTotals, list[Finished], Any, float]


def _pd_tight() -> Deployment:
    """1P1D with a small decode pool (back-pressure on the prefills' held blocks) and the
    transfer overlapped with the prefill."""
    base = deployment(GPT_OSS_20B, blocks=400)
    split = split_pd(base, 1, 1)
    assert split.disaggregation is not None
    return attrs.evolve(split, disaggregation=attrs.evolve(split.disaggregation, overlap=True))


def _disturb(eng: Engine, ids: list[int], rnd: random.Random, done: set[int]) -> None:
    """Between cutoffs: sometimes abort a live request, sometimes submit a late one."""
    if rnd.random() < 0.3:
        live = [i for i in ids if i not in done]
        if live:
            rid = live[rnd.randrange(len(live))]
            eng.abort(rid)
            done.add(rid)
    if rnd.random() < 0.3:
        late = RequestSpec(
            prompt_tokens=rnd.randint(20, 400),
            max_tokens=rnd.randint(1, 60),
            arrival_time=max(0.0, eng.now - 1e-4),
        )
        ids.append(eng.submit(late))


def _cutoffs(seed: int, horizon: float) -> list[float]:
    rnd = random.Random(seed)
    out, t = [], 0.0
    while t < horizon:
        t += rnd.expovariate(4.0)
        out.append(t)
    return [*out, math.inf]


def _drive(dep: Deployment, specs: list[RequestSpec], seed: int, runs: bool) -> Outcome:
    """The workload on a fresh engine, to the end: in ``run_until`` calls (``runs``) or
    one ``step()`` at a time, with the same disturbances at the same cutoffs."""
    eng = Engine(dep)
    ids = [
        eng.submit(s) for s in specs if eng.check_fits(s.prompt_tokens, s.max_tokens, s.n) is None
    ]
    totals = StepTotals(speculative=dep.speculative is not None)
    finished: list[Finished] = []
    rnd = random.Random(seed)
    options = random.Random(seed + 1)
    done: set[int] = set()
    for cutoff in _cutoffs(seed, specs[-1].arrival_time + 5.0):
        if runs:
            while (t := eng.next_event_time()) is not None and t < cutoff:
                eng.run_until(
                    cutoff,
                    totals,
                    finished,
                    stop_on_finish=options.random() < 0.3,
                    stop_at_arrival=options.random() < 0.3,
                )
                if (t := eng.next_event_time()) is not None and t < cutoff:
                    ev = eng.step()  # (the caller's own handling of what stopped it)
                    if ev.step is not None:
                        totals.add(ev.step)
                    finished.extend(ev.finished)
        else:
            while (t := eng.next_event_time()) is not None and t < cutoff:
                ev = eng.step()
                if ev.step is not None:
                    totals.add(ev.step)
                finished.extend(ev.finished)
        done.update(f.request_id for f in finished)
        if eng.next_event_time() is None and cutoff != math.inf:
            continue
        _disturb(eng, ids, rnd, done)
    return totals, finished, eng.statistics(), eng.now


def _same(a: Outcome, b: Outcome) -> None:
    ta, tb = a[0], b[0]
    assert len(ta) == len(tb)
    for column in ("kv_usage", "flop_util", "bw_util"):
        assert ta.column(column).tobytes() == tb.column(column).tobytes(), column
    assert (ta.preempted, ta.drafts, ta.draft_tokens, ta.accepted_tokens) == (
        tb.preempted,
        tb.drafts,
        tb.draft_tokens,
        tb.accepted_tokens,
    )
    assert (ta.time_s, ta.plain_time_s) == (tb.time_s, tb.plain_time_s)
    assert a[1] == b[1]
    assert a[2] == b[2]
    assert a[3] == b[3]


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_run_until_is_step_by_step(name: str, seed: int) -> None:
    """Every scenario, two seeds: the runs and the single steps agree to the bit."""
    dep, kw = SCENARIOS[name]()
    specs = _specs(500, seed, **kw)
    stepped = _drive(dep, specs, seed, runs=False)
    ran = _drive(dep, specs, seed, runs=True)
    _same(stepped, ran)
    assert len(stepped[1]) > 100  # (the workload did run)


def test_decode_runs_do_happen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain deployment under load hands a good share of its boundaries to decode runs
    (so the comparison above covers them), some of many boundaries at once."""
    seen: list[int] = []
    original = fast_module.FastPath.decode_run

    def counting(self: Any, *args: Any, **kw: Any) -> Any:
        run = original(self, *args, **kw)
        seen.append(0 if run is None else run.started)
        return run

    monkeypatch.setattr(fast_module.FastPath, "decode_run", counting)
    dep, kw = SCENARIOS["gpt-oss-light"]()
    eng = Engine(dep)
    for s in _specs(800, 3, **kw):
        eng.submit(s)
    totals = StepTotals()
    eng.run_until(math.inf, totals, [])
    assert sum(seen) > len(totals) // 5, (sum(seen), len(totals))
    assert max(seen) >= 20


def test_a_run_stops_at_the_next_event() -> None:
    """No boundary at or after the cutoff is handled: the engine's clock stays before it
    and the next event is at or after it (an arrival at a boundary's time comes first)."""
    dep, kw = SCENARIOS["gpt-oss-loaded"]()
    eng = Engine(dep)
    for s in _specs(300, 4, **kw):
        eng.submit(s)
    totals = StepTotals()
    for cutoff in (0.05, 0.3, 0.31, 1.0):
        eng.run_until(cutoff, totals, [])
        assert eng.now < cutoff
        nxt = eng.next_event_time()
        assert nxt is None or nxt >= cutoff


def test_an_arrival_is_left_to_the_caller_when_asked() -> None:
    """With ``stop_at_arrival`` the next event on return is an arrival (or later than
    the cutoff): the caller handles it itself, as the simulator does under a queue bound."""
    dep, kw = SCENARIOS["llama-full-attention"]()
    eng = Engine(dep)
    specs = _specs(50, 5, **kw)
    for s in specs:
        eng.submit(s)
    report = eng.run_until(math.inf, StepTotals(), [], stop_at_arrival=True)
    assert report.arrivals == 0
    assert eng.next_event_time() == specs[0].arrival_time
    ev = eng.step()
    assert ev.arrived


def test_the_report_gives_the_queue_at_mid_and_end() -> None:
    """The report's queue figures are those the simulator read after each arrival."""
    dep = attrs.evolve(deployment(LLAMA8B, max_num_seqs=4))
    eng = Engine(dep)
    specs = _specs(40, 6, rate=400.0)
    for s in specs:
        eng.submit(s)
    mid = specs[19].arrival_time
    report = eng.run_until(math.inf, StepTotals(), [], mid=mid)
    stepped = Engine(dep)
    for s in specs:
        stepped.submit(s)
    peak = at_mid = at_end = 0
    while stepped.next_event_time() is not None:
        ev = stepped.step()
        if ev.arrived or (ev.step is not None and ev.step.preempted):
            waiting = stepped.num_waiting()
            peak = max(peak, waiting)
            if ev.arrived:
                if ev.time <= mid:
                    at_mid = waiting
                at_end = waiting
    assert (report.peak_waiting, report.waiting_at_mid, report.waiting_at_end) == (
        peak,
        at_mid,
        at_end,
    )
    assert report.arrivals == 40 and peak > 0


@pytest.mark.parametrize(
    ("make", "rate", "stop"),
    [
        (lambda: deployment(GPT_OSS_20B), 60.0, False),
        (lambda: deployment(GPT_OSS_20B, blocks=500), 120.0, False),
        (lambda: deployment(LLAMA8B, replicas=2), 90.0, False),
        (lambda: deployment(GPT_OSS_20B), 60.0, True),
    ],
)
def test_a_run_records_fields_as_its_finished(make: Any, rate: float, stop: bool) -> None:
    """Rule 4 of the runs: ``run_until`` with ``record`` hands each completion over as the
    first twelve fields of the ``Finished`` it would append, in the same order (with
    ``stop_on_finish`` it appends them, as without ``record``): the same table to the
    bit as the same runs without it."""
    dep = make()
    specs = _specs(400, 5, rate=rate)
    tables = []
    for direct in (False, True):
        eng = Engine(dep)
        for s in specs:
            eng.submit(s)
        table = FinishedTable()
        ended: list[Finished] = []
        totals = StepTotals()
        while eng.next_event_time() is not None:
            eng.run_until(
                eng.now + 0.25,
                totals,
                ended,
                stop_on_finish=stop,
                record=table.add_fields if direct else None,
            )
            table.extend(ended)
            ended.clear()
        assert len(table) == len(specs)
        tables.append(table)
    plain, direct = tables
    assert list(plain) == list(direct)
    for name in ("arrival_time", "finish_time", "first_token_time", "output_tokens"):
        assert plain.column(name).tobytes() == direct.column(name).tobytes()
