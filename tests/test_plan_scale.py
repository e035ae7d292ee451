"""``inference-lab plan`` before it runs: the candidate space counted without being built
and built lazily, the estimate of its simulations and time, the line that says both up
front (``-q`` too), and the cap that refuses a spec of 10^6 candidates without
``--max-candidates`` and without holding them."""

from __future__ import annotations

import itertools
import json
import time
import tracemalloc
from pathlib import Path

import pytest

from inference_lab import cli
from inference_lab.executors.backends import InlineExecutor
from inference_lab.plan.cache import ResultCache
from inference_lab.plan.estimate import estimate, format_duration
from inference_lab.plan.jobs import run_job
from inference_lab.plan.planner import first_job, run_plan
from inference_lab.plan.spec import (
    count_candidates,
    expand_candidates,
    iter_candidates,
    load_spec,
)
from tests.plan_util import SPEC, answer, write_spec

#: 2 models x 2 GPUs x 5 tp x 10 replicas x 1,000 max_num_seqs x 5 policies = 10^6.
MILLION = SPEC.replace("tp = [1]", "tp = [1, 2, 3, 4, 5]").replace(
    "replicas = [1, 2]",
    "replicas = { start = 1, stop = 10 }\n\n[scheduler]\nmax_num_seqs = { start = 1, stop = 1000 }\n"
    'policy = ["fcfs", "priority", "sjf", "ljf", "fcfs"]',
)


def test_the_count_is_the_built_space_and_the_space_is_built_lazily(tmp_path: Path) -> None:
    """spec Rule 4: ``count_candidates`` is the length of the space ``expand_candidates``
    builds; a 10^6-candidate spec is counted and its first candidates taken without the
    rest being built (a few MB, where the list held ~900 MB)."""
    small = load_spec(write_spec(tmp_path))
    assert count_candidates(small) == len(expand_candidates(small)) == 8
    big = load_spec(write_spec(tmp_path, MILLION, "million.toml"))
    tracemalloc.start()
    try:
        assert count_candidates(big) == 1_000_000
        first = list(itertools.islice(iter_candidates(big), 3))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [c.index for c in first] == [0, 1, 2]
    assert [c.knobs for c in first] == [
        (("max_num_seqs", 1), ("policy", "fcfs")),
        (("max_num_seqs", 1), ("policy", "priority")),
        (("max_num_seqs", 1), ("policy", "sjf")),
    ]
    assert peak < 20 * 2**20, peak


def test_the_planner_takes_candidates_from_an_iterator(tmp_path: Path) -> None:
    """planner Rule 5: the same plan from the lazy iterator (with its count) as from the
    list; a primed job counts as run, not cached, and the cache then holds exactly the
    jobs run."""
    spec = load_spec(write_spec(tmp_path))
    listed = run_plan(
        spec, expand_candidates(spec), InlineExecutor(run_job), ResultCache(tmp_path / "a")
    )
    cache = ResultCache(tmp_path / "b")
    primed = first_job(spec, expand_candidates(spec)[0])
    cache.put(run_job(primed))
    lazy = run_plan(
        spec, iter_candidates(spec), InlineExecutor(run_job), cache, total=8, primed={primed.key}
    )
    assert answer(lazy) == answer(listed)
    assert (lazy.jobs_run, lazy.jobs_cached) == (listed.jobs_run, listed.jobs_cached)
    assert len(cache) == lazy.jobs_run


def test_the_estimate_follows_the_stopping_rule(tmp_path: Path) -> None:
    """estimate Rule 2 by hand for the test spec: start 40, min 0.05, max 1500, rel_tol
    0.25: bisect ceil(log2 4) = 2, bracket up ceil(log2 37.5) = 6, down ceil(log2 800) = 10;
    two SLO sets share the start probe. Rule 3: the time is the typical count x the probe
    over the workers."""
    spec = load_spec(write_spec(tmp_path))
    est = estimate(spec, 8, 0.5, 2)
    assert est.simulations == 8 * (1 + 2 * (1 + 2))
    assert est.at_most == 8 * (1 + 2 * (10 + 2))
    assert est.seconds == pytest.approx(56 * 0.5 / 2)
    assert est.line() == (
        "8 candidates x 2 SLO set(s): about 56 simulations (at most 200) of ~0.5 s each: "
        "about 14 s on 2 workers"
    )
    assert estimate(spec, 8, None, 1).line().endswith("; no runnable candidate to time")
    assert [format_duration(s) for s in (45, 600, 7200, 10 * 86400)] == [
        "45 s",
        "10.0 min",
        "2.0 h",
        "10 days",
    ]


def test_quiet_says_up_front_how_many_simulations_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """plan cli Rule 4: with ``-q`` stdout is the cheapest lines only, and stderr opens
    with the estimate's line; the probe timed for it is the plan's (run once, counted as
    run: the cache holds exactly the jobs the plan says it ran)."""
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    argv = ["plan", str(spec), "--out-dir", str(out), "--inline", "-q", "--no-progress"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert all(line.startswith("cheapest for ") for line in captured.out.splitlines())
    first = captured.err.splitlines()[0]
    assert first.startswith(
        "inference-lab plan: 8 candidates x 2 SLO set(s): about 56 simulations (at most 200) of ~"
    )
    assert first.endswith(" on 1 worker")
    doc = json.loads((out / "plan.json").read_text())
    assert doc["jobs"]["run"] == len(ResultCache(out / "cache"))


def test_a_million_candidates_are_refused_up_front_without_being_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """plan cli Rule 4: the count and the projected time first, then one line refusing
    the spec (exit 1) and naming --max-candidates; nothing planned, one probe timed, and
    no more than a few MB held (tracemalloc's peak) where the whole list took ~900 MB."""
    spec = write_spec(tmp_path, MILLION, "million.toml")
    out = tmp_path / "out"
    tracemalloc.start()
    started = time.perf_counter()
    try:
        rc = cli.main(["plan", str(spec), "--out-dir", str(out), "--inline", "-q"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rc == 1
    estimate_line, refusal = capsys.readouterr().err.splitlines()
    assert estimate_line.startswith(
        "inference-lab plan: 1,000,000 candidates x 2 SLO set(s): about 7,000,000 simulations"
    )
    assert " on 1 worker" in estimate_line
    assert refusal == (
        f"inference-lab plan: error: {spec}: 1,000,000 candidates is more than "
        "--max-candidates 1,000: narrow the spec's axes, or pass --max-candidates 1000000"
    )
    assert not (out / "plan.json").exists() and len(ResultCache(out / "cache")) == 1
    assert peak < 50 * 2**20, peak
    assert time.perf_counter() - started < 120  # generous: the list alone took minutes


def test_max_candidates_raises_the_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A spec over a lowered cap is refused; the same spec at its count runs."""
    spec = write_spec(tmp_path)
    base = ["plan", str(spec), "--out-dir", str(tmp_path / "o"), "--inline", "-q"]
    assert cli.main([*base, "--max-candidates", "7", "--no-progress"]) == 1
    assert "8 candidates is more than --max-candidates 7" in capsys.readouterr().err
    assert cli.main([*base, "--max-candidates", "8", "--no-progress"]) == 0


@pytest.mark.parametrize(
    ("mode", "hint"),
    [
        (None, "(if the cluster uses token authentication, set RAY_AUTH_MODE=token and its "
               "token in RAY_AUTH_TOKEN or ~/.ray/auth_token)"),
        ("token", "(with RAY_AUTH_MODE=token: is the token the head's?)"),
    ],
)  # fmt: skip
def test_a_ray_address_that_refuses_the_driver_says_how_to_give_the_token(
    mode: str | None,
    hint: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster with token authentication refuses a driver without the token, and Ray says
    only that it failed to connect: the line adds how to give the token."""
    from inference_lab.plan import cli as plan_cli

    def refused(args: object) -> None:
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")

    monkeypatch.setattr(plan_cli, "_executor", refused)
    if mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    spec = write_spec(tmp_path)
    argv = ["plan", str(spec), "--out-dir", str(tmp_path / "o"), "--ray", "10.0.0.1:6379"]
    assert cli.main([*argv, "-q", "--no-progress"]) == 1
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == (
        "inference-lab plan: error: Failed to connect to Ray cluster at 10.0.0.1:6379 " + hint
    )


def test_a_ray_address_where_nothing_listens_fails_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plan --ray 127.0.0.1:PORT`` with no cluster there (a port just freed): one line
    naming the address, without a token hint (nothing listens, so no token would help),
    before Ray is imported (the executors' ``ray_backend`` Rule 5, as ``sim --ray``)."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    spec = write_spec(tmp_path)
    argv = ["plan", str(spec), "--out-dir", str(tmp_path / "o"), "--ray", f"127.0.0.1:{port}"]
    assert cli.main([*argv, "-q", "--no-progress"]) == 1
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == (
        f"inference-lab plan: error: --ray 127.0.0.1:{port}: no Ray cluster answers there "
        "(Connection refused)"
    )
    assert "ray" not in sys.modules
