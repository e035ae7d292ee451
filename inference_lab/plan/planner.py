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


class _PlanDriver:
    """One `run_plan` call's state: the candidates open (at most ``limit``), the searches
    waiting for each job in flight, the finished results and the counts."""

    def __init__(
        self,
        spec: PlanSpec,
        candidates: Iterable[Candidate],
        executor: Executor[Job, ProbeResult],
        cache: ResultCache,
        limit: int,
        primed: Collection[str],
    ) -> None:
        self.spec, self.executor, self.cache, self.limit = spec, executor, cache, limit
        self.queue = iter(candidates)
        self.primed_keys = frozenset(primed)
        self.unasked = set(self.primed_keys)
        self.finished: dict[int, CandidateResult] = {}
        self.open: dict[int, _Open] = {}
        self.in_flight: dict[str, list[tuple[int, str]]] = {}  # job key -> waiting searches
        self.counts = {"run": 0, "cached": 0, "failed": 0}

    def progress(self, total: int) -> PlanProgress:
        return PlanProgress(
            candidates_done=len(self.finished),
            candidates_total=total,
            jobs_run=self.counts["run"],
            jobs_cached=self.counts["cached"],
            jobs_in_flight=len(self.in_flight),
        )

    def close_if_done(self, index: int) -> None:
        entry = self.open[index]
        if all(s.done for s in entry.searches.values()):
            del self.open[index]
            self.finished[index] = CandidateResult(
                candidate=entry.candidate,
                outcomes={
                    name: s.outcome for name, s in entry.searches.items() if s.outcome is not None
                },
            )

    def advance(self, index: int, name: str) -> None:
        """Drive one search until it waits for a job in flight or is done (cache hits are
        fed at once)."""
        entry = self.open[index]
        search = entry.searches[name]
        while search.next_rate is not None:
            job = _job(self.spec, entry.candidate, search.next_rate)
            if job.key in self.in_flight:
                self.in_flight[job.key].append((index, name))
                return
            cached = self.cache.get(job.key)
            if cached is None:
                self.in_flight[job.key] = [(index, name)]
                self.executor.submit(job)
                return
            if job.key in self.unasked:  # Rule 5: run by the caller for the estimate
                self.unasked.discard(job.key)
                self.counts["run"] += 1
            elif job.key not in self.primed_keys:  # its other asks would have found it in flight
                self.counts["cached"] += 1
            search.feed(cached)

    def open_more(self) -> None:
        spec = self.spec
        while len(self.open) < self.limit:
            cand = next(self.queue, None)
            if cand is None:
                return
            if cand.deployment is None:
                self.finished[cand.index] = CandidateResult(candidate=cand, outcomes={})
                continue
            self.open[cand.index] = _Open(
                candidate=cand,
                searches={
                    s.name: RateSearch(s, spec.search, spec.start_rate) for s in spec.slo_sets
                },
            )
            for name in list(self.open[cand.index].searches):
                self.advance(cand.index, name)
            self.close_if_done(cand.index)

    def answered(self, job: Job, outcome: ProbeResult | JobFailure) -> None:
        """Feed a job's answer to every search waiting for it, then open more candidates."""
        waiters = self.in_flight.pop(job.key, [])
        if isinstance(outcome, JobFailure):
            self.counts["failed"] += 1
        else:
            self.counts["run"] += 1
            self.cache.put(outcome)
        for index, name in waiters:
            search = self.open[index].searches[name]
            if isinstance(outcome, ProbeResult):
                search.feed(outcome)
            else:
                search.fail(f"job failed: {outcome.message}")
            self.advance(index, name)
        for index in {index for index, _ in waiters}:
            self.close_if_done(index)
        self.open_more()


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
    driver = _PlanDriver(spec, candidates, executor, cache, limit, primed)
    driver.open_more()
    if progress is not None:
        progress(driver.progress(total))
    for job, outcome in executor.results():
        driver.answered(job, outcome)
        if progress is not None:
            progress(driver.progress(total))
    assert not driver.open, "every search ends when its jobs have answered"
    return PlanResult(
        spec=spec,
        candidates=tuple(driver.finished[i] for i in sorted(driver.finished)),
        jobs_run=driver.counts["run"],
        jobs_cached=driver.counts["cached"],
        jobs_failed=driver.counts["failed"],
        wall_s=time.perf_counter() - start,
    )
