"""``inference-lab plan``: the spec and its candidate space, the rate search's stopping
rule, pure jobs and their keys, the results cache, the backends (a worker killed with
``kill -9`` is retried), resuming and growing a plan, the report and the command.

Plans here are small (requests of at most 288 tokens, probes of half a simulated second)
so each one runs in seconds; the Ray backend has its own file (test_plan_ray.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from inference_lab import cli
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.core.engine import StepEvents
from inference_lab.errors import ConfigError
from inference_lab.executors import backends
from inference_lab.executors.backends import InlineExecutor, ProcessExecutor
from inference_lab.plan import jobs as jobs_module
from inference_lab.plan.cache import ResultCache
from inference_lab.plan.jobs import (
    ITL_PERCENTILES,
    Job,
    ProbeResult,
    make_job,
    probe_workload,
    run_job,
)
from inference_lab.plan.planner import PlanProgress, PlanResult, run_plan
from inference_lab.plan.report import Row, cheapest, pareto_front, rows
from inference_lab.plan.search import RateSearch, good_requests, slo_value_ms, verdict
from inference_lab.plan.spec import (
    SearchConfig,
    Slo,
    SloSet,
    expand_candidates,
    load_prices,
    load_spec,
)
from tests.plan_util import CONFIGS, SPEC, answer, fake_probe, write_spec
from tests.test_cli import SERVE_STACK, loaded_after

ROOT = Path(__file__).resolve().parent.parent


def plan(
    spec_path: Path,
    cache_dir: Path,
    executor: backends.Executor[Job, ProbeResult] | None = None,
    **kw: Any,
) -> PlanResult:
    """The spec at `spec_path` planned with `executor` (default in-process), closed after."""
    spec = load_spec(spec_path)
    ex = executor if executor is not None else InlineExecutor(run_job)
    try:
        return run_plan(spec, expand_candidates(spec), ex, ResultCache(cache_dir), **kw)
    finally:
        ex.close()


# -- the spec --------------------------------------------------------------------------


def test_candidates_are_the_cross_product_in_order_with_reasons_for_misfits(
    tmp_path: Path,
) -> None:
    """models x hardware x tp x replicas in the spec's order; Llama-3-70B on one H100 is
    kept with the loader's one-line reason, every other candidate has its deployment with
    the tp and replica count asked for."""
    spec = load_spec(write_spec(tmp_path))
    cands = expand_candidates(spec)
    assert [(c.model, c.hardware, c.replicas) for c in cands] == [
        (m, hw, r)
        for m in ("gpt-oss-20b", "Llama-3-70B")
        for hw in ("h100", "b200")
        for r in (1, 2)
    ]
    for c in cands:
        if c.model == "Llama-3-70B" and c.hardware == "h100":
            assert c.deployment is None and c.error is not None
            assert "hardware.h100: resident weights" in c.error and "\n" not in c.error
        else:
            assert c.error is None and c.deployment is not None
            assert (c.deployment.hardware.tp, c.deployment.hardware.replicas) == (c.tp, c.replicas)
    assert [c.index for c in cands] == list(range(len(cands)))


def test_a_hardware_name_without_an_entry_uses_its_profile(tmp_path: Path) -> None:
    """gpt-oss-20b's config has no [hardware.h100]: the candidate is built from
    hardware_profiles/h100.toml with the config's scheduler, priced from the table."""
    spec = load_spec(write_spec(tmp_path))
    (cand,) = [c for c in expand_candidates(spec) if c.model == "gpt-oss-20b" and c.hardware == "h100" and c.replicas == 1]  # fmt: skip
    assert cand.deployment is not None
    assert cand.deployment.profile.name == "NVIDIA H100"
    assert cand.deployment.scheduler.block_size == 64  # gpt-oss-20b's [scheduler]
    assert cand.price == load_prices()["h100"] and cand.cost_per_hour == cand.price


def test_scheduler_knobs_and_ranges_multiply_the_space(tmp_path: Path) -> None:
    """A scheduler knob's list and a range table are axes like tp and replicas; each
    candidate's deployment carries its values."""
    text = SPEC.replace("replicas = [1, 2]", "replicas = { start = 1, stop = 4, factor = 2 }")
    text = text.replace("[search]", "[scheduler]\nmax_num_seqs = [8, 64]\n\n[search]")
    spec = load_spec(write_spec(tmp_path, text))
    assert spec.replicas == (1, 2, 4)
    cands = expand_candidates(spec)
    assert len(cands) == 2 * 2 * 3 * 2
    seqs = [(c.knobs, c.deployment.scheduler.max_num_seqs) for c in cands if c.deployment]
    assert {k for k, _ in seqs} == {(("max_num_seqs", 8),), (("max_num_seqs", 64),)}
    assert all(dict(k)["max_num_seqs"] == v for k, v in seqs)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("tp = [1]", "tp = [0]", "plan.toml: tp: every value must be an integer >= 1, got 0"),
        ("tp = [1]", "tp = { start = 1 }", "plan.toml: tp.stop: must be an integer"),
        ("tp = [1]", "tpp = [1]", "plan.toml: tpp: unknown key"),
        ("rel_tol = 0.25", "rel_tol = 0", "plan.toml: search.rel_tol: must be > 0"),
        (
            "duration_s = 0.5",
            "duration_s = 1e12",
            "plan.toml: search.duration_s: a probe at max_rate (1500/s) for 1e+12 s offers "
            "1.5e+15 requests, more than the 2,000,000 a probe may",
        ),  # fmt: skip
        (
            "duration_s = 0.5",
            "duration_s = inf",
            "plan.toml: search.duration_s: a probe at max_rate (1500/s) for inf s offers inf",
        ),  # fmt: skip
        (
            "replicas = [1, 2]",
            "replicas = { start = 1, stop = 1_000_000_000_000 }",
            "plan.toml: replicas: the range holds 1,000,000,000,000 values, more than 1,000",
        ),  # fmt: skip
        (
            "replicas = [1, 2]",
            "replicas = [1, 100_000_000]",
            "plan.toml: replicas: every value must be at most 1,024, got 100000000",
        ),  # fmt: skip
        (
            "min_requests = 20",
            "min_requests = 100_000_000",
            "plan.toml: search.min_requests: must be at most 2,000,000",
        ),  # fmt: skip
        (
            "rel_tol = 0.25",
            "rel_tol = 0.25\nrequests = 5",
            "plan.toml: search.requests: unknown key",
        ),  # fmt: skip
        (
            "ttft_p99_ms = 30",
            "ttft_p99_ms = -1",
            "plan.toml: slo.tight.ttft_p99_ms: must be a number of ms > 0",
        ),  # fmt: skip
        ("ttft_p99_ms = 30", "ttfb_p99_ms = 30", "plan.toml: slo.tight.ttfb_p99_ms: not a bound"),
        (
            "ttft_p99_ms = 30",
            'ttft_p99_ms = 30\n"itl_p99.95_ms" = 5',
            "an ITL percentile must be a multiple of 0.1",
        ),  # fmt: skip
        (
            "ttft_p99_ms = 30",
            "tpot_p99_ms = 30",
            "plan.toml: slo.tight: bound TTFT, E2E or queue too",
        ),  # fmt: skip
        (
            "[search]",
            "[scheduler]\nmax_num_seqs = [8, 7.5]\n\n[search]",
            "plan.toml: scheduler.max_num_seqs: must be an integer, got 7.5",
        ),  # fmt: skip
        (
            "[search]",
            "[scheduler]\nmax_seqs = [8]\n\n[search]",
            "plan.toml: scheduler.max_seqs: unknown key",
        ),  # fmt: skip
        (
            "[search]",
            "[prices]\nh100 = -2\n\n[search]",
            "plan.toml: prices.h100: must be a number >= 0",
        ),  # fmt: skip
        ('workload = "workload.toml"', 'workload = "nope.toml"', "nope.toml: no such file"),
        (
            'hardware = ["h100", "b200"]',
            'hardware = ["h100", "b201"]',
            "hardware.b201: no such entry and no hardware profile",
        ),  # fmt: skip
    ],
)
def test_spec_errors_are_one_line_naming_the_file_and_key(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    """Every problem of a spec is found when it is loaded (or its space expanded) and told
    in one line naming the file and the key."""
    assert old in SPEC
    path = write_spec(tmp_path, SPEC.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        expand_candidates(load_spec(path))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_prices_come_from_the_shipped_table_and_the_spec_overrides_them(tmp_path: Path) -> None:
    """The shipped table prices every profile it names; the spec's [prices] replaces or adds
    entries; a profile priced nowhere leaves its candidates without a cost."""
    shipped = load_prices()
    assert {"a100", "h100", "h200", "b200", "mi300x"} <= set(shipped)
    assert all(v > 0 for v in shipped.values())
    text = SPEC.replace("[search]", "[prices]\nh100 = 1.5\nb200 = 0\n\n[search]")
    spec = load_spec(write_spec(tmp_path, text))
    assert spec.prices["h100"] == 1.5 and spec.prices["a100"] == shipped["a100"]
    text = SPEC.replace('hardware = ["h100", "b200"]', 'hardware = ["gh200"]')
    text = text.replace(f'"{CONFIGS / "Llama-3-70B.toml"}"', "")
    spec = load_spec(write_spec(tmp_path, text.replace(", ]", "]")))
    assert all(c.price is None and c.cost_per_hour is None for c in expand_candidates(spec))


def test_the_shipped_example_spec_loads() -> None:
    """configs/plans/chat-20rps.toml (docs/planning.md's example) loads; its space holds
    candidates that run and candidates whose weights do not fit."""
    spec = load_spec(CONFIGS / "plans" / "chat-20rps.toml")
    cands = expand_candidates(spec)
    assert len(cands) == 5 * 3 * 2 and spec.target_rate == 20
    assert any(c.deployment is None for c in cands) and any(c.deployment for c in cands)


# -- the search ------------------------------------------------------------------------

TTFT_100MS = SloSet("s", (Slo("ttft", 99.0, 100.0),))


def drive(search: RateSearch, capacity: float) -> list[tuple[float, bool]]:
    """Feed `search` probes that pass exactly when the rate is at most `capacity`."""
    while search.next_rate is not None:
        rate = search.next_rate
        search.feed(fake_probe(rate, [0.01] * 10 if rate <= capacity else [1.0] * 10))
    assert search.outcome is not None
    return list(search.outcome.probes)


def test_the_search_doubles_to_a_bracket_then_bisects_to_the_tolerance() -> None:
    """From 10 req/s with a capacity of 37: 10, 20 pass, 40 fails; bisection probes 30,
    35, 37.5, 36.25 and stops once fail - pass <= 5 % of pass; the answer is the highest
    rate that passed."""
    search = RateSearch(TTFT_100MS, SearchConfig(rel_tol=0.05), 10.0)
    probes = drive(search, 37.0)
    assert probes == [
        (10.0, True),
        (20.0, True),
        (40.0, False),
        (30.0, True),
        (35.0, True),
        (37.5, False),
        (36.25, True),
    ]
    assert search.outcome is not None
    assert search.outcome.max_rate == 36.25 and not search.outcome.capped
    assert search.outcome.at_max is not None and search.outcome.at_max.rate == 36.25


def test_the_search_halves_from_a_failing_start_and_stops_at_its_bounds() -> None:
    """A failing start halves; below min_rate there is no rate (0.0, not a failure);
    passing at max_rate caps the search there."""
    cfg = SearchConfig(min_rate=1.0, max_rate=64.0, rel_tol=0.1)
    search = RateSearch(TTFT_100MS, cfg, 10.0)
    assert [r for r, _ in drive(search, 3.0)][:3] == [10.0, 5.0, 2.5]
    assert search.outcome is not None and 2.5 <= search.outcome.max_rate <= 3.0

    low = RateSearch(TTFT_100MS, cfg, 10.0)
    assert [r for r, _ in drive(low, 0.5)] == [10.0, 5.0, 2.5, 1.25, 1.0]
    assert low.outcome is not None and low.outcome.max_rate == 0.0
    assert "misses the SLOs at min_rate 1" in low.outcome.reason

    high = RateSearch(TTFT_100MS, cfg, 10.0)
    assert [r for r, _ in drive(high, 1000.0)] == [10.0, 20.0, 40.0, 64.0]
    assert high.outcome is not None and high.outcome.max_rate == 64.0 and high.outcome.capped


def test_an_error_or_too_many_refusals_end_the_search_with_the_reason() -> None:
    """Neither depends on the rate, so the first such probe ends the search as a failure
    with its one-line reason."""
    search = RateSearch(TTFT_100MS, SearchConfig(), 10.0)
    search.feed(fake_probe(10.0, [], error="workload: cannot run"))
    assert search.outcome is not None and search.outcome.max_rate is None
    assert search.outcome.reason == "workload: cannot run"

    refusing = RateSearch(TTFT_100MS, SearchConfig(max_refused=0.1), 10.0)
    refusing.feed(fake_probe(10.0, [0.01] * 9, refused=1))  # 10 %: allowed
    assert not refusing.done and refusing.next_rate == 20.0
    refusing.feed(fake_probe(20.0, [0.01] * 8, refused=2))
    assert refusing.outcome is not None and refusing.outcome.max_rate is None
    assert refusing.outcome.reason == "2 of 10 requests refused: prompt too long"


def test_slo_values_are_percentiles_of_the_completed_requests_and_itl_grid() -> None:
    """A request-level SLO reads numpy's linear percentile of the probe's requests (NaN
    TPOTs of one-token requests left out); an ITL SLO reads the kept grid."""
    probe = fake_probe(5.0, [0.1, 0.2, 0.3, 0.4], tpot_s=[0.01, np.nan, 0.03, 0.05])
    assert slo_value_ms(probe, Slo("ttft", 90.0, 1.0)) == pytest.approx(
        np.percentile([100, 200, 300, 400], 90)
    )
    assert slo_value_ms(probe, Slo("tpot", 50.0, 1.0)) == pytest.approx(30.0)
    assert slo_value_ms(probe, Slo("itl", 99.9, 1.0)) == pytest.approx(9.99)
    assert ITL_PERCENTILES[999] == 99.9
    ok, why = verdict(probe, SloSet("s", (Slo("ttft", 90.0, 300.0),)), SearchConfig())
    assert not ok and why == "over the bound: TTFT p90 370.0 ms"


def test_good_requests_meet_every_per_request_bound() -> None:
    """A request is good when its TTFT, TPOT, E2E and queue are within every bound of the
    set; a one-token request (no TPOT) meets a TPOT bound; ITL bounds classify nobody."""
    probe = fake_probe(5.0, [0.1, 0.2, 0.3], tpot_s=[0.05, np.nan, 0.2])
    slos = SloSet("s", (Slo("ttft", 99, 250.0), Slo("tpot", 99, 100.0), Slo("itl", 99, 0.001)))
    assert good_requests(probe, slos).tolist() == [True, True, False]


# -- jobs and the cache ------------------------------------------------------------------


def _job(rate: float = 50.0, config: Path = CONFIGS / "gpt-oss-20b.toml") -> Job:
    dep = load_deployment(config, "b200")
    lengths = load_workload(CONFIGS / "workloads" / "quick.toml")
    return make_job(dep, probe_workload(lengths, rate, 40, 3))


def test_a_job_key_is_its_content_and_the_code_not_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same config copied elsewhere gives the same key; another rate, another key;
    another code version, another key."""
    copy = tmp_path / "configs" / "gpt-oss-20b.toml"
    copy.parent.mkdir()
    copy.write_text((CONFIGS / "gpt-oss-20b.toml").read_text())
    (tmp_path / "hardware_profiles").symlink_to(ROOT / "hardware_profiles")
    assert _job(config=copy).key == _job().key
    assert _job(rate=51.0).key != _job().key
    key = _job().key
    monkeypatch.setattr("inference_lab.plan.jobs.code_version", lambda: "other")
    assert _job().key != key


def test_the_code_version_reads_the_subpackages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change to a module in a subpackage of a hashed folder (``core/config/``) changes
    the code version, as a change to a workload generator does."""
    for name in ("core/engine.py", "core/config/loading.py", "sim/run.py", "errors.py",
                 "validation.py", "plan/jobs.py", "workload/open_loop.py"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(jobs_module, "_PACKAGE", tmp_path)
    version = jobs_module.code_version.__wrapped__
    before = version()
    (tmp_path / "core/config/loading.py").write_text("# changed\n")
    assert version() != before
    (tmp_path / "core/config/loading.py").write_text("# core/config/loading.py\n")
    assert version() == before
    (tmp_path / "workload/open_loop.py").write_text("# changed\n")
    assert version() != before


def test_run_job_is_a_pure_function_of_the_job() -> None:
    """Twice the same job: the same answer (only the wall time and the worker may differ);
    every request completes or is refused; ITL percentiles rise along the grid."""
    job = _job()
    a, b = run_job(job), run_job(job)
    assert a.same_answer(b)
    assert a.completed + a.refused == a.requests == 40 and a.key == job.key
    assert a.latencies.ttft.size == a.completed and not a.error
    assert np.all(np.diff(a.itl) >= 0) and a.itl[-1] > 0


def test_the_cache_round_trips_and_writes_whole_entries_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored result reads back equal; an unreadable entry is a miss; a write interrupted
    (Ctrl-C inside numpy's writer) leaves neither the entry nor its temporary file; a
    temporary file left by a killed plan is removed when the cache is next opened."""
    cache = ResultCache(tmp_path / "c")
    result = run_job(_job())
    cache.put(result)
    got = cache.get(result.key)
    assert got is not None and got.same_answer(result) and result.key in cache

    cache.path(result.key).write_bytes(b"not an archive")
    assert cache.get(result.key) is None

    other = run_job(_job(rate=60.0))

    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.put(other)
    monkeypatch.undo()
    assert other.key not in cache
    assert not list((tmp_path / "c").glob("*/.*.tmp"))

    stale = cache.path(other.key).parent / f".{other.key}.999.tmp"
    stale.write_bytes(b"half")
    reopened = ResultCache(tmp_path / "c")
    assert not stale.exists() and reopened.removed_temporaries == 1


# -- the planner and its backends ------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PlanResult]:
    """The small spec planned in-process with a fresh cache: the answer the other backends
    must give."""
    base = tmp_path_factory.mktemp("ref")
    spec = write_spec(base)
    return spec, plan(spec, base / "cache")


def test_the_small_plan_finds_rates_and_reports_misfits(reference: tuple[Path, PlanResult]) -> None:
    """Every runnable candidate ends its searches; the misfits have no outcome; probes shared
    by the two SLO sets ran once."""
    _, result = reference
    probes = 0
    for cr in result.candidates:
        if cr.candidate.deployment is None:
            assert cr.outcomes == {}
            continue
        assert set(cr.outcomes) == {"tight", "loose"}
        for o in cr.outcomes.values():
            probes += len(o.probes)
            assert o.max_rate is None or o.max_rate >= 0
    ok = [o for cr in result.candidates for o in cr.outcomes.values() if o.max_rate]
    assert ok and result.jobs_cached == 0 and result.jobs_failed == 0
    assert result.jobs_run < probes  # the first probe of each candidate served both sets


def test_a_process_pool_gives_the_same_answer_after_a_worker_is_killed(
    tmp_path: Path, reference: tuple[Path, PlanResult]
) -> None:
    """Two worker processes; after the first result one worker gets SIGKILL: the broken
    pool is replaced, the jobs it held run again, and the plan's answer is exactly the
    in-process one."""
    spec, expected = reference
    executor = ProcessExecutor(run_job, 2)
    killed: list[int] = []

    def kill_one(p: PlanProgress) -> None:
        if p.jobs_run >= 1 and not killed:
            pid = executor.worker_pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    result = plan(spec, tmp_path / "cache", executor, progress=kill_one)
    stats = executor.statistics()
    assert killed and stats.restarts >= 1 and stats.retried >= 1  # jobs in flight ran again
    assert answer(result) == answer(expected)
    assert executor.worker_pids() == []  # closed: no worker left


def test_a_job_submitted_after_a_worker_died_is_sent_to_the_new_pool() -> None:
    """A worker dies, the pool's in-flight job fails with BrokenProcessPool, and only then is
    another job submitted (the planner submits between results): neither submit nor the
    iteration raises; both jobs are answered, by a new pool, with run_job's own answer."""
    from concurrent.futures import wait as wait_futures

    executor = ProcessExecutor(run_job, 1)
    first, second = _job(rate=50.0), _job(rate=60.0)
    try:
        executor.submit(first)
        os.kill(executor.worker_pids()[0], signal.SIGKILL)
        wait_futures(list(executor._futures))  # the pool is now broken (private: the test's view)
        executor.submit(second)
        got = {job.key: outcome for job, outcome in executor.results()}
    finally:
        executor.close()
    assert set(got) == {first.key, second.key}
    for job in (first, second):
        outcome = got[job.key]
        assert isinstance(outcome, ProbeResult) and outcome.same_answer(run_job(job))
    stats = executor.statistics()
    assert stats.restarts == 1 and stats.retried == 1 and stats.completed == 2


def _flaky(job: Job) -> ProbeResult:
    """`run_job`, with a bug in every simulation on h100."""
    if job.deployment.hardware_name == "h100":
        raise RuntimeError("boom")
    return run_job(job)


def test_a_job_that_raises_fails_only_its_candidate(
    tmp_path: Path, reference: tuple[Path, PlanResult]
) -> None:
    """A bug in one candidate's simulation is that candidate's reason; the other
    candidates' answers are untouched and nothing failed is cached."""
    spec, expected = reference
    result = plan(spec, tmp_path / "cache", InlineExecutor(_flaky))
    for got, want in zip(result.candidates, expected.candidates, strict=True):
        if got.candidate.hardware == "h100" and got.candidate.deployment is not None:
            assert {o.reason for o in got.outcomes.values()} == {"job failed: RuntimeError: boom"}
            assert all(o.max_rate is None for o in got.outcomes.values())
        else:
            assert answer(attrs.evolve(result, candidates=(got,))) == answer(
                attrs.evolve(expected, candidates=(want,))
            )
    assert result.jobs_failed > 0 and len(ResultCache(tmp_path / "cache")) == result.jobs_run


def test_an_interrupted_plan_resumes_from_its_cache(
    tmp_path: Path, reference: tuple[Path, PlanResult]
) -> None:
    """Ctrl-C after five simulations: every cache entry is whole, and the same plan run
    again takes those five from the cache and gives the uninterrupted answer."""
    spec, expected = reference

    def interrupt(p: PlanProgress) -> None:
        if p.jobs_run >= 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        plan(spec, tmp_path / "cache", InlineExecutor(run_job), progress=interrupt)
    cache = ResultCache(tmp_path / "cache")
    keys = [p.stem for p in (tmp_path / "cache").glob("*/*.npz")]
    assert len(keys) == 5 and all(cache.get(k) is not None for k in keys)
    resumed = plan(spec, tmp_path / "cache")
    assert resumed.jobs_cached >= 5 and answer(resumed) == answer(expected)
    assert resumed.jobs_run + 5 == expected.jobs_run


def test_a_plan_grown_by_one_knob_reuses_every_finished_run(tmp_path: Path) -> None:
    """The space grown by a second replica count: every simulation of the first plan comes
    from the cache, and the shared candidates' answers do not move."""
    one = SPEC.replace("replicas = [1, 2]", "replicas = [1]").replace(
        "[slo.loose]\ne2e_p90_ms = 200\ntpot_p50_ms = 10\n", ""
    )
    small = plan(write_spec(tmp_path, one, "one.toml"), tmp_path / "cache")
    grown_text = one.replace("replicas = [1]", "replicas = [1, 2]")
    grown = plan(write_spec(tmp_path, grown_text, "two.toml"), tmp_path / "cache")
    assert grown.jobs_cached == small.jobs_run > 0
    shared = [cr for cr in grown.candidates if cr.candidate.replicas == 1]
    same = [answer(attrs.evolve(grown, candidates=(cr,)))[1:] for cr in shared]
    assert same == [answer(attrs.evolve(small, candidates=(cr,)))[1:] for cr in small.candidates]


# -- the report ------------------------------------------------------------------------


def test_the_ranking_puts_the_cheapest_deployment_that_carries_the_target_first(
    tmp_path: Path, reference: tuple[Path, PlanResult]
) -> None:
    """With a target rate: the candidates that reach it by $/h, then those below it, then
    those with no rate, then the failures; $/Mtok and goodput follow their definitions;
    the Pareto front holds exactly the undominated priced candidates."""
    spec_path, expected = reference
    spec = attrs.evolve(load_spec(spec_path), target_rate=300.0)
    result = attrs.evolve(expected, spec=spec)
    for name, ranked in rows(result).items():
        assert [r.rank for r in ranked] == list(range(1, len(ranked) + 1))
        groups = [0 if r.first_group else 1 if r.status == "ok" else 2 if r.status == "none" else 3 for r in ranked]  # fmt: skip
        assert groups == sorted(groups)
        first = [r for r in ranked if r.first_group]
        assert all(r.max_rate is not None and r.max_rate >= 300 for r in first)
        costs = [r.cost_per_hour or 0.0 for r in first]
        assert costs == sorted(costs)
        assert cheapest(ranked) is (first[0] if first else None)
        for r in ranked:
            if r.status == "ok" and r.usd_per_mtok is not None:
                assert r.cost_per_hour is not None and r.goodput_tok_s is not None
                assert r.usd_per_mtok == pytest.approx(r.cost_per_hour / (r.goodput_tok_s * 3600) * 1e6)  # fmt: skip
                outcome = result.candidates[r.candidate.index].outcomes[name]
                assert outcome.at_max is not None
                slo_set = next(s for s in spec.slo_sets if s.name == name)
                good = good_requests(outcome.at_max, slo_set)
                assert r.goodput_rps == pytest.approx(r.max_rate * good.mean() * outcome.at_max.completed / outcome.at_max.requests)  # fmt: skip
        front = pareto_front(ranked)
        priced = [r for r in ranked if r.status == "ok" and r.cost_per_hour is not None]

        def beats(a: Row, b: Row) -> bool:
            assert a.goodput_tok_s is not None and b.goodput_tok_s is not None
            assert a.cost_per_hour is not None and b.cost_per_hour is not None
            return (
                a.goodput_tok_s >= b.goodput_tok_s
                and a.cost_per_hour <= b.cost_per_hour
                and (a.goodput_tok_s > b.goodput_tok_s or a.cost_per_hour < b.cost_per_hour)
            )

        for r in priced:
            assert (r in front) == (not any(beats(o, r) for o in priced))
    rows_tight = rows(result)["tight"]
    assert rows_tight[-1].status == "failed" and "do not fit" in rows_tight[-1].reason


# -- the command -----------------------------------------------------------------------


def test_the_command_prints_the_report_and_writes_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan SPEC --out-dir DIR --inline``: exit 0, the tables and the cheapest lines,
    plan.json (cheapest, Pareto, every row), plan.csv (one row per candidate and SLO set)
    and pareto.png; run again (with ``-o DIR``, the older spelling), every simulation comes
    from the cache."""
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    argv = ["plan", str(spec), "--out-dir", str(out), "--inline", "--no-progress"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "SLO set tight: TTFT p99 <= 30 ms" in text and "cheapest for loose:" in text
    assert "resident weights" in text  # the misfits' reason
    doc = json.loads((out / "plan.json").read_text())
    assert set(doc["cheapest"]) == {"tight", "loose"} and len(doc["results"]["tight"]) == 8
    assert doc["cheapest"]["tight"]["rank"] == 1
    lines = (out / "plan.csv").read_text().strip().splitlines()
    assert len(lines) == 1 + 8 * 2 and lines[0].startswith("slo_set,rank,model")
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    legacy = ["plan", str(spec), "-o", str(out), "--inline", "--no-progress"]
    assert cli.main(legacy) == 0  # -o DIR: the older spelling of --out-dir, with a note
    captured = capsys.readouterr()
    assert "0 simulations run" in captured.out
    assert "note: -o/--out DIR is spelled --out-dir DIR now" in captured.err


def test_command_errors_are_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad spec, and --ray without Ray installed: one line on stderr, exit 1."""
    bad = write_spec(tmp_path, SPEC.replace("tp = [1]", "tp = [0]"))
    assert cli.main(["plan", str(bad), "--out-dir", str(tmp_path / "o"), "--inline"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("inference-lab plan: error: ") and "tp: every value" in err
    assert "\n" not in err
    # duration_s = 1e12 ran out of memory and printed "none meets it", exit 0 (issue 45)
    huge = write_spec(tmp_path, SPEC.replace("duration_s = 0.5", "duration_s = 1e12"))
    assert cli.main(["plan", str(huge), "--out-dir", str(tmp_path / "o"), "--inline"]) == 1
    err = capsys.readouterr().err.strip()
    assert "search.duration_s: a probe at max_rate" in err and "\n" not in err
    good = write_spec(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    assert cli.main(["plan", str(good), "--out-dir", str(tmp_path / "o"), "--ray", "local"]) == 1
    assert "--ray needs Ray: pip install 'inference-lab[ray]'" in capsys.readouterr().err


def test_plan_does_not_import_the_serve_stack(tmp_path: Path) -> None:
    """A whole ``inference-lab plan`` run (process pool) loads neither trio, quart nor
    hypercorn, nor Ray, nor the other subcommands' modules."""
    spec = write_spec(tmp_path)
    argv = ["plan", str(spec), "--out-dir", str(tmp_path / "o"), "-j", "1", "-q"]
    rc, loaded, out = loaded_after(argv)
    assert rc == 0 and "cheapest for tight" in out
    assert not loaded & (SERVE_STACK | {"ray"}), loaded & (SERVE_STACK | {"ray"})
    assert not {"inference_lab.serve.cli", "inference_lab.client"} & loaded


def test_request_latencies_agree_with_the_sim_summary_and_the_events_hook() -> None:
    """The planner's per-request latencies have the summary's definitions (the same
    percentiles), and ``run_simulation``'s ``on_events`` sees every token it emits."""
    from inference_lab.sim.run import run_simulation
    from inference_lab.sim.summary import LatencyStats, request_latencies

    job = _job()
    tokens = [0]

    def count(ev: StepEvents) -> None:
        tokens[0] += sum(c for _, c in ev.tokens)

    result = run_simulation(job.deployment, job.workload, on_events=count)
    lat = request_latencies(result.finished)
    s = result.summary
    for name in ("ttft", "e2e", "queue"):
        assert LatencyStats.from_seconds(getattr(lat, name)) == getattr(s, name)
    assert LatencyStats.from_seconds(lat.tpot[~np.isnan(lat.tpot)]) == s.tpot
    assert int(lat.output_tokens.sum()) == s.output_tokens == tokens[0]
