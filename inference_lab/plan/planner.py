"""The planner: every candidate's rate searches, over any executor, through the cache.

Rule 1: a candidate is searched once per SLO set; the searches ask for probes, the
        planner turns each probe into a job and answers it from the cache, from a job of
        the same key already in flight (two searches never run the same job twice), or by
        submitting it. Every result a worker returns is cached (cache.py) before it is fed
        to the searches, so an interrupted plan loses only the jobs in flight.
Rule 2: at most `window` candidates are open at a time (about twice the executor's
        parallelism), opened in the spec's order: the executor always has work, and
        candidates finish one after another (the progress bar's ETA means something, a
        Ctrl-C leaves whole candidates cached).
Rule 3: the outcome is a function of the spec, the seed and the code only: the searches'
        answers do not depend on the executor, on the completion order or on what was
        cached (jobs are pure, searches are deterministic in their own results).
Rule 4: a candidate without a deployment (it cannot fit) is reported with its reason and
        runs no job; a job that fails (`JobFailure`) fails the searches waiting for it with
        that reason and nothing else; nothing a candidate does aborts the plan.
Rule 5: candidates are taken from their iterable as they are opened (spec Rule 4): the
        planner holds the open candidates and the finished results, never the space.
        A job the caller ran before the plan (``primed``: the estimate's probe, cached
        by then, a candidate's first probe) counts as run the first time a search asks
        for it and is not counted again (the candidate's other searches ask for it at
        once, when it would be in flight), so the counts are those of an unprimed plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable

import attrs

from inference_lab.executors.backends import Executor, JobFailure
from inference_lab.plan.cache import ResultCache
from inference_lab.plan.jobs import Job, ProbeResult, make_job, probe_workload
from inference_lab.plan.search import RateSearch, SearchOutcome
from inference_lab.plan.spec import Candidate, PlanSpec

__all__ = ["CandidateResult", "PlanProgress", "PlanResult", "first_job", "run_plan"]


@attrs.frozen(kw_only=True)
class CandidateResult:
    """A candidate and its search outcome per SLO set (empty when it has no deployment)."""

    candidate: Candidate
    outcomes: dict[str, SearchOutcome]


@attrs.frozen(kw_only=True)
class PlanProgress:
    """A sample for the progress bar, taken after every event the planner handles."""

    candidates_done: int
    candidates_total: int
    jobs_run: int  # results returned by the executor
    jobs_cached: int  # probes answered from the cache (per search that asked)
    jobs_in_flight: int


@attrs.frozen(kw_only=True)
class PlanResult:
    """Everything a plan produced, candidates in the spec's order."""

    spec: PlanSpec
    candidates: tuple[CandidateResult, ...]
    jobs_run: int
    jobs_cached: int
    jobs_failed: int
    wall_s: float


@attrs.define
class _Open:
    candidate: Candidate
    searches: dict[str, RateSearch]


def first_job(spec: PlanSpec, candidate: Candidate) -> Job:
    """The job a runnable candidate's searches ask first (the start rate, clamped and
    rounded as `RateSearch` does): what the estimate times (Rule 5)."""
    assert candidate.deployment is not None
    rate = RateSearch(spec.slo_sets[0], spec.search, spec.start_rate).next_rate
    assert rate is not None
    return _job(spec, candidate, rate)


def _job(spec: PlanSpec, cand: Candidate, rate: float) -> Job:
    assert cand.deployment is not None
    workload = probe_workload(spec.workload, rate, spec.search.requests_at(rate), spec.seed)
    return make_job(cand.deployment, workload)


def run_plan(
    spec: PlanSpec,
    candidates: Iterable[Candidate],
    executor: Executor[Job, ProbeResult],
    cache: ResultCache,
    progress: Callable[[PlanProgress], None] | None = None,
    window: int | None = None,
    total: int | None = None,
    primed: Collection[str] = (),
) -> PlanResult:
    """Search every candidate (the module's Rules). ``total`` is how many ``candidates``
    yields (default ``len(candidates)``), for the progress samples. The caller owns
    `executor` and closes it, also when this raises (KeyboardInterrupt included)."""
    start = time.perf_counter()
    limit = window if window is not None else max(2, 2 * executor.parallelism)
    if total is None:
        assert isinstance(candidates, Collection), "give total with a lazy iterable"
        total = len(candidates)
    queue = iter(candidates)
    primed_keys = frozenset(primed)
    unasked = set(primed_keys)
    finished: dict[int, CandidateResult] = {}
    open_: dict[int, _Open] = {}
    in_flight: dict[str, list[tuple[int, str]]] = {}  # job key -> waiting searches
    counts = {"run": 0, "cached": 0, "failed": 0}

    def report() -> None:
        if progress is not None:
            progress(
                PlanProgress(
                    candidates_done=len(finished),
                    candidates_total=total,
                    jobs_run=counts["run"],
                    jobs_cached=counts["cached"],
                    jobs_in_flight=len(in_flight),
                )
            )

    def close_if_done(index: int) -> None:
        entry = open_[index]
        if all(s.done for s in entry.searches.values()):
            del open_[index]
            finished[index] = CandidateResult(
                candidate=entry.candidate,
                outcomes={
                    name: s.outcome for name, s in entry.searches.items() if s.outcome is not None
                },
            )

    def advance(index: int, name: str) -> None:
        """Drive one search until it waits for a job in flight or is done (cache hits are
        fed at once)."""
        entry = open_[index]
        search = entry.searches[name]
        while search.next_rate is not None:
            job = _job(spec, entry.candidate, search.next_rate)
            if job.key in in_flight:
                in_flight[job.key].append((index, name))
                return
            cached = cache.get(job.key)
            if cached is None:
                in_flight[job.key] = [(index, name)]
                executor.submit(job)
                return
            if job.key in unasked:  # Rule 5: run by the caller for the estimate
                unasked.discard(job.key)
                counts["run"] += 1
            elif job.key not in primed_keys:  # its other asks would have found it in flight
                counts["cached"] += 1
            search.feed(cached)

    def open_more() -> None:
        while len(open_) < limit:
            cand = next(queue, None)
            if cand is None:
                return
            if cand.deployment is None:
                finished[cand.index] = CandidateResult(candidate=cand, outcomes={})
                continue
            open_[cand.index] = _Open(
                candidate=cand,
                searches={
                    s.name: RateSearch(s, spec.search, spec.start_rate) for s in spec.slo_sets
                },
            )
            for name in list(open_[cand.index].searches):
                advance(cand.index, name)
            close_if_done(cand.index)

    open_more()
    report()
    for job, outcome in executor.results():
        waiters = in_flight.pop(job.key, [])
        if isinstance(outcome, JobFailure):
            counts["failed"] += 1
        else:
            counts["run"] += 1
            cache.put(outcome)
        for index, name in waiters:
            search = open_[index].searches[name]
            if isinstance(outcome, ProbeResult):
                search.feed(outcome)
            else:
                search.fail(f"job failed: {outcome.message}")
            advance(index, name)
        for index in {index for index, _ in waiters}:
            close_if_done(index)
        open_more()
        report()
    assert not open_, "every search ends when its jobs have answered"
    return PlanResult(
        spec=spec,
        candidates=tuple(finished[i] for i in sorted(finished)),
        jobs_run=counts["run"],
        jobs_cached=counts["cached"],
        jobs_failed=counts["failed"],
        wall_s=time.perf_counter() - start,
    )
