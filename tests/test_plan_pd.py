"""``inference-lab plan`` with prefill/decode splits: the ``disaggregation`` axis and
``gpu_budget``, split candidates beside aggregated ones of the same GPUs, their jobs and
keys, ``sim``'s own figures, the search's limit, and the report's comparison.

Plans here use Llama-3.1-8B-Instruct on H100 with requests of at most 288 tokens and
probes of half a simulated second, so a whole plan takes seconds.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import attrs
import numpy as np
import pytest

from inference_lab import cli
from inference_lab.core.config import load_deployment, load_workload, split_pd, vary_deployment
from inference_lab.errors import ConfigError
from inference_lab.executors.backends import InlineExecutor
from inference_lab.plan.cache import ResultCache
from inference_lab.plan.compare import comparisons, reason, ttft_stages
from inference_lab.plan.jobs import make_job, run_job
from inference_lab.plan.planner import PlanResult, first_job, run_plan
from inference_lab.plan.report import Row, rows
from inference_lab.plan.search import Miss, RateSearch
from inference_lab.plan.spec import (
    SearchConfig,
    Slo,
    SloSet,
    Split,
    count_candidates,
    expand_candidates,
    load_spec,
)
from inference_lab.sim.run import run_simulation
from inference_lab.sim.summary import request_latencies
from tests.plan_util import CONFIGS, WORKLOAD, fake_probe, write_spec

LLAMA8B = CONFIGS / "Llama-3.1-8B-Instruct.toml"

PD_SPEC = f"""\
workload = "workload.toml"
models = ["{LLAMA8B}"]
hardware = ["h100"]
tp = [1]
disaggregation = ["1P1D", "2P1D", "1P2D"]

[search]
duration_s = 0.5
min_requests = 20
start_rate = 40
max_rate = 1500
rel_tol = 0.25

[slo.tight]
ttft_p99_ms = 40

[slo.loose]
e2e_p90_ms = 200
tpot_p50_ms = 10
"""


def pd_plan(tmp_path: Path, text: str = PD_SPEC) -> PlanResult:
    spec = load_spec(write_spec(tmp_path, text))
    executor = InlineExecutor(run_job)
    try:
        return run_plan(spec, expand_candidates(spec), executor, ResultCache(tmp_path / "cache"))
    finally:
        executor.close()


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> PlanResult:
    return pd_plan(tmp_path_factory.mktemp("pd"))


# -- the spec --------------------------------------------------------------------------


def test_splits_follow_the_aggregated_candidates_of_their_gpu_counts(tmp_path: Path) -> None:
    """Without ``replicas``, the aggregated counts are the splits' totals (2, 3), so each
    split meets the aggregated candidate of its GPUs; a split's deployment is ``--pd``'s
    split of the same entry, tp and scheduler."""
    spec = load_spec(write_spec(tmp_path, PD_SPEC))
    assert spec.replicas == (2, 3)
    assert spec.disaggregation == (Split(1, 1), Split(2, 1), Split(1, 2))
    cands = expand_candidates(spec)
    assert [(c.layout, c.replicas, c.gpus) for c in cands] == [
        ("aggregated", 2, 2),
        ("aggregated", 3, 3),
        ("1P1D", 2, 2),
        ("2P1D", 3, 3),
        ("1P2D", 3, 3),
    ]
    base = load_deployment(LLAMA8B, "h100")
    for c in cands:
        assert c.deployment is not None and c.error is None
        if c.split is None:
            assert c.deployment.disaggregation is None
            assert c.label == f"Llama-3.1-8B-Instruct h100 tp1 x{c.replicas}"
            continue
        assert c.label == f"Llama-3.1-8B-Instruct h100 tp1 {c.split.name}"
        pools = c.deployment.disaggregation
        assert pools is not None and pools.gpus == c.gpus
        assert (pools.prefill.hardware.replicas, pools.decode.hardware.replicas) == (
            c.split.prefill,
            c.split.decode,
        )
        same = split_pd(vary_deployment(base, tp=1), *attrs.astuple(c.split))
        assert c.deployment == same


def test_a_split_table_under_a_gpu_budget_is_counted_as_built(tmp_path: Path) -> None:
    """A table of prefill and decode ranges is their cross product less the pairs over the
    budget; tp 2 leaves every layout but none over 3 GPUs out; the count is the space."""
    text = PD_SPEC.replace("tp = [1]", "tp = [1, 2]\ngpu_budget = 3").replace(
        'disaggregation = ["1P1D", "2P1D", "1P2D"]',
        "disaggregation = { prefill = { start = 1, stop = 3 }, decode = [1, 2] }",
    )
    spec = load_spec(write_spec(tmp_path, text))
    assert [s.name for s in spec.disaggregation] == ["1P1D", "1P2D", "2P1D"]
    cands = expand_candidates(spec)
    assert [(c.tp, c.layout) for c in cands] == [
        (1, "aggregated"),
        (1, "aggregated"),
        (1, "1P1D"),
        (1, "1P2D"),
        (1, "2P1D"),
    ]
    assert count_candidates(spec) == len(cands) == 5
    assert all(c.gpus <= 3 for c in cands)


def test_explicit_replicas_stay_as_written(tmp_path: Path) -> None:
    text = PD_SPEC.replace("tp = [1]", "tp = [1]\nreplicas = [4]")
    spec = load_spec(write_spec(tmp_path, text))
    assert spec.replicas == (4,)
    assert [c.label.split()[-1] for c in expand_candidates(spec)] == ["x4", "1P1D", "2P1D", "1P2D"]


@pytest.mark.parametrize(
    ("new", "message"),
    [
        ('disaggregation = ["0P1D"]', "plan.toml: disaggregation: 0P1D: each pool needs at least one replica"),
        ('disaggregation = ["1P0D"]', "plan.toml: disaggregation: 1P0D: each pool needs at least one replica"),
        ('disaggregation = ["2X1"]', 'plan.toml: disaggregation: expected a split such as "2P1D", got \'2X1\''),
        ("disaggregation = [2]", 'plan.toml: disaggregation: expected a split such as "2P1D", got 2'),
        ("disaggregation = []", "plan.toml: disaggregation: must have at least one split"),
        ('disaggregation = ["1P2000D"]', "plan.toml: disaggregation: 1P2000D: a pool holds at most 1,024"),
        ("disaggregation = 3", "plan.toml: disaggregation: must be a list of splits"),
        (
            'disaggregation = ["1P1D", "2P2D"]\ngpu_budget = 3',
            "plan.toml: disaggregation: 2P2D uses at least 4 GPUs (tp 1), more than gpu_budget = 3",
        ),
        (
            "disaggregation = { prefill = [0, 1], decode = 1 }",
            "plan.toml: disaggregation.prefill: every value must be an integer >= 1, got 0",
        ),
        (
            "disaggregation = { prefill = 1 }",
            "plan.toml: disaggregation.decode: missing: the pool's replica counts",
        ),
        (
            "disaggregation = { prefill = 1, decode = 1, ratio = 2 }",
            "plan.toml: disaggregation.ratio: unknown key (prefill, decode)",
        ),
        (
            "disaggregation = { prefill = [2, 3], decode = 2 }\ngpu_budget = 3",
            "plan.toml: disaggregation: no split of its ranges fits gpu_budget = 3",
        ),
        (
            'disaggregation = ["1P1D"]\nreplicas = [2, 4]\ngpu_budget = 3',
            "plan.toml: replicas: 4 replicas use at least 4 GPUs, more than gpu_budget = 3",
        ),
        (
            'disaggregation = ["1P1D"]\ngpu_budget = 0',
            "plan.toml: gpu_budget: must be >= 1, got 0",
        ),
    ],
)  # fmt: skip
def test_bad_splits_and_budgets_are_one_line_naming_the_key(
    tmp_path: Path, new: str, message: str
) -> None:
    path = write_spec(tmp_path, PD_SPEC.replace('disaggregation = ["1P1D", "2P1D", "1P2D"]', new))
    with pytest.raises(ConfigError) as info:
        expand_candidates(load_spec(path))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_tp_over_the_budget_is_an_error_and_the_command_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_spec(tmp_path, PD_SPEC.replace("tp = [1]", "tp = [1, 4]\ngpu_budget = 3"))
    assert cli.main(["plan", str(path), "--out-dir", str(tmp_path / "o"), "--inline"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"inference-lab plan: error: {path}: tp: tp 4 uses 4 GPUs per replica, more than "
        "gpu_budget = 3"
    )


def test_a_split_that_cannot_run_keeps_its_reason(tmp_path: Path) -> None:
    """A split of a deployment that cannot be split (the shipped EAGLE config's
    speculative decoding) is a candidate with the loader's one-line reason naming the
    spec's key, not an error of the spec; its aggregated candidates run."""
    eagle = CONFIGS / "frontier" / "Llama-3.1-8B-Instruct-EAGLE.toml"
    spec = load_spec(write_spec(tmp_path, PD_SPEC.replace(str(LLAMA8B), str(eagle))))
    cands = expand_candidates(spec)
    assert all(c.deployment is not None for c in cands if c.split is None)
    splits = [c for c in cands if c.split is not None]
    assert len(splits) == 3 and all(c.deployment is None for c in splits)
    for c in splits:
        assert c.error == (
            f"{spec.path}: disaggregation: {c.layout}: not modelled with [speculative] "
            "(a drafter per pool)"
        )


def test_the_shipped_pd_spec_loads() -> None:
    """configs/plans/pd-h200.toml (docs/planning.md's example): every split of at most 4
    GPUs after 2, 3 and 4 aggregated replicas, all runnable."""
    spec = load_spec(CONFIGS / "plans" / "pd-h200.toml")
    cands = expand_candidates(spec)
    assert [c.label.split()[-1] for c in cands] == [
        "x2", "x3", "x4", "1P1D", "1P2D", "1P3D", "2P1D", "2P2D", "3P1D",
    ]  # fmt: skip
    assert count_candidates(spec) == 9 and all(c.deployment is not None for c in cands)


# -- jobs, keys, and sim's figures -----------------------------------------------------


def test_the_split_is_in_the_job_key(tmp_path: Path) -> None:
    """Three layouts of 3 GPUs at one rate: three keys; the same split built twice: one."""
    spec = load_spec(write_spec(tmp_path, PD_SPEC))
    by_layout = {c.layout + str(c.replicas): c for c in expand_candidates(spec)}
    keys = {name: first_job(spec, c).key for name, c in by_layout.items()}
    assert len(set(keys.values())) == len(keys) == 5
    again = {c.layout + str(c.replicas): c for c in expand_candidates(spec)}
    assert first_job(spec, again["2P1D3"]).key == keys["2P1D3"]


def test_a_split_probe_is_sims_run_of_the_same_deployment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 2P1D candidate's first probe against ``inference-lab sim --pd 2P1D`` on a
    workload file of the probe's arrivals: the same job (deployment and workload), the
    same per-request latencies as ``run_simulation``, and the P/D figures and TTFT p99 that
    ``sim -o`` writes."""
    spec = load_spec(write_spec(tmp_path, PD_SPEC))
    (cand,) = [c for c in expand_candidates(spec) if c.layout == "2P1D"]
    job = first_job(spec, cand)
    probe = run_job(job)
    assert probe.pd is not None and probe.completed == probe.requests == 20

    wl = tmp_path / "probe.toml"
    wl.write_text(
        WORKLOAD.replace("arrival_rate = 10.0", f"arrival_rate = {job.rate!r}")
        .replace("num_requests = 100", f"num_requests = {job.workload.num_requests}")
        .replace("seed = 7", f"seed = {spec.seed}")
    )
    sim_dep = split_pd(load_deployment(LLAMA8B, "h100"), 2, 1)
    loaded = load_workload(wl)
    assert make_job(sim_dep, loaded).key == job.key  # the same deployment and arrivals
    direct = run_simulation(sim_dep, loaded)
    lat = request_latencies(direct.finished)
    for name in ("ttft", "tpot", "e2e", "queue", "output_tokens"):
        assert np.array_equal(getattr(probe.latencies, name), getattr(lat, name), equal_nan=True)

    out = tmp_path / "sim.json"
    argv = ["sim", "--config", str(LLAMA8B), "--hardware", "h100", "--workload", str(wl)]
    assert cli.main([*argv, "--pd", "2P1D", "-o", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    pd = doc["disaggregation"]
    assert probe.pd.queue_ms == pd["ttft_queue"]["mean"]
    assert probe.pd.prefill_ms == pd["ttft_prefill"]["mean"]
    assert probe.pd.handoff_ms == pd["ttft_handoff"]["mean"]
    assert probe.pd.first_decode_ms == pd["ttft_first_decode"]["mean"]
    assert probe.pd.prefill_busy == pd["prefill"]["busy_share"]
    assert probe.pd.decode_busy == pd["decode"]["busy_share"]
    assert probe.pd.transfer_bytes == pd["transfer_bytes_mean"]
    ttft_p99 = float(np.percentile(probe.latencies.ttft, 99)) * 1e3
    assert ttft_p99 == pytest.approx(doc["latency_ms"]["ttft"]["p99"], rel=1e-12)


def test_the_cache_keeps_a_splits_figures(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, PD_SPEC))
    (cand,) = [c for c in expand_candidates(spec) if c.layout == "1P2D"]
    result = run_job(first_job(spec, cand))
    cache = ResultCache(tmp_path / "c")
    cache.put(result)
    got = cache.get(result.key)
    assert got is not None and got.same_answer(result) and got.pd == result.pd
    assert result.pd is not None and result.pd.transfer_bytes > 0


# -- the search's limit ----------------------------------------------------------------


def test_the_search_names_the_bound_the_lowest_failing_rate_missed() -> None:
    """From 10 req/s with capacity 37 (TTFT fails above it): the limit is the TTFT miss
    of the lowest failing probe, 37.5 req/s."""
    slos = SloSet("s", (Slo("ttft", 99.0, 100.0), Slo("tpot", 99.0, 50.0)))
    search = RateSearch(slos, SearchConfig(rel_tol=0.05), 10.0)
    while search.next_rate is not None:
        rate = search.next_rate
        search.feed(fake_probe(rate, [0.01] * 10 if rate <= 37 else [rate / 100] * 10))
    outcome = search.outcome
    assert outcome is not None and outcome.max_rate == 36.25
    assert outcome.limit_rate == 37.5
    assert outcome.limit == (Miss("TTFT p99", pytest.approx(375.0)),)
    assert outcome.limit[0].text == "TTFT p99 375.0 ms"


# -- the plan and its report -----------------------------------------------------------


def test_a_plan_with_both_kinds_ranks_them_and_says_why(planned: PlanResult) -> None:
    """Every candidate is searched; the splits' rows carry sim's P/D figures, whose stages
    add up to their mean TTFT; each group of 2 and 3 GPUs is compared, its winner the
    member of the highest rate, its verdict naming it against the other kind."""
    ranked = rows(planned)
    for name, set_rows in ranked.items():
        assert {r.candidate.layout for r in set_rows} == {"aggregated", "1P1D", "2P1D", "1P2D"}
        for r in set_rows:
            assert r.status == "ok" and r.max_rate
            assert (r.pd is not None) == (r.candidate.split is not None)
            assert r.ttft_mean_ms is not None
            assert sum(v for _, v in ttft_stages(r)) == pytest.approx(r.ttft_mean_ms)
            assert r.capped or (r.limit and r.limit_rate and r.limit_rate > r.max_rate)
            assert reason(r).startswith("limit ")
            if r.pd is not None:
                assert f"transfer {r.pd.transfer_s * 1e3:,.1f} ms" in reason(r)
        groups = comparisons(set_rows)
        assert [g.gpus for g in groups] == [2, 3]
        assert [len(g.members) for g in groups] == [2, 3]
        for g in groups:
            rates = [m.max_rate or 0.0 for m in g.members]
            assert rates == sorted(rates, reverse=True) and g.winner is g.members[0]
            winner = g.members[0].candidate
            named = winner.split.name if winner.split else f"{winner.replicas} aggregated"
            assert g.verdict.startswith(named), (name, g.verdict)


def _with_rate(row: Row, rate: float) -> Row:
    return attrs.evolve(row, max_rate=rate, capped=False)


def test_the_verdict_names_the_winner_against_the_other_kind(planned: PlanResult) -> None:
    """Rates set by hand on the 3-GPU group: a split ahead, aggregated ahead, a tie, and
    an aggregated member with no rate."""
    set_rows = rows(planned)["tight"]
    agg, p2, p1 = (
        next(r for r in set_rows if r.candidate.layout == lay and r.candidate.gpus == 3)
        for lay in ("aggregated", "2P1D", "1P2D")
    )

    def verdict(a: float, b: float, c: float) -> str:
        rs = [_with_rate(agg, a), _with_rate(p2, b), _with_rate(p1, c)]
        (group,) = comparisons(rs)
        return group.verdict

    assert verdict(3.0, 4.06, 1.0) == "2P1D beats 3 aggregated replicas (4.06 against 3.00 req/s)"
    assert verdict(5.0, 4.0, 4.5) == "3 aggregated replicas beat 1P2D (5.00 against 4.50 req/s)"
    assert verdict(4.0, 4.0, 1.0).endswith("tie at 4.00 req/s")
    none = attrs.evolve(agg, status="none", max_rate=0.0)
    (group,) = comparisons([none, _with_rate(p2, 2.0), _with_rate(p1, 1.0)])
    assert group.verdict == "2P1D carries 2.00 req/s; 3 aggregated replicas meet no rate"
    (group,) = comparisons([_with_rate(p2, 2.0)])
    assert group.verdict == "2P1D carries 2.00 req/s (no aggregated candidate of these GPUs)"


def test_the_command_prints_the_layouts_and_writes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table gains P/D and limit columns and each set a comparison; plan.csv and
    plan.json carry each row's layout, limit, TTFT stages and P/D figures."""
    spec = write_spec(tmp_path, PD_SPEC)
    out = tmp_path / "out"
    assert cli.main(["plan", str(spec), "--out-dir", str(out), "--inline", "--no-progress"]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("#  model"))
    assert header.split()[:8] == ["#", "model", "hw", "tp", "rep", "P/D", "knobs", "GPUs"]
    assert header.endswith("limit")
    assert text.count("P/D against aggregated at the same GPUs") == 2
    assert "Llama-3.1-8B-Instruct on 3 x h100 (tp 1): " in text
    assert "hand-off" in text and "busy prefill" in text
    with open(out / "plan.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 2 * 5
    split_rows = [r for r in table if r["layout"] != "aggregated"]
    assert {(r["layout"], r["prefill_replicas"], r["decode_replicas"]) for r in split_rows} == {
        ("1P1D", "1", "1"),
        ("2P1D", "2", "1"),
        ("1P2D", "1", "2"),
    }
    assert all(json.loads(r["pd"])["transfer_bytes"] > 0 for r in split_rows)
    assert all(set(json.loads(r["ttft_stages_ms"])) == {"queue", "prefill", "hand-off", "first decode"} for r in split_rows)  # fmt: skip
    doc = json.loads((out / "plan.json").read_text())
    assert doc["disaggregation"] == ["1P1D", "2P1D", "1P2D"]
    assert [len(g["ranking"]) for g in doc["comparisons"]["tight"]] == [2, 3]
    assert doc["results"]["tight"][0]["candidate"]["layout"] in {
        "aggregated",
        "1P1D",
        "2P1D",
        "1P2D",
    }
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plan_without_splits_prints_the_table_it_always_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = PD_SPEC.replace('disaggregation = ["1P1D", "2P1D", "1P2D"]', "replicas = [1]")
    spec = write_spec(tmp_path, text)
    assert cli.main(["plan", str(spec), "--out-dir", str(tmp_path / "o"), "--inline", "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("#  model"))
    assert "P/D" not in header and "limit" not in header
    assert "P/D against aggregated" not in out
