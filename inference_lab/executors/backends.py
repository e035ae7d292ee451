"""Where pure jobs run: one small interface, three implementations.

An `Executor` takes jobs (`submit`) and yields each one's outcome as it completes
(`results`); its caller never knows which implementation it holds. Each is made with the
job's function (`run`: a module-level function, so a pool worker or a Ray task can
import it), which it calls on each job:

- `InlineExecutor`: in this process, one job at a time, in submission order (tests);
- `ProcessExecutor`: a local process pool (default: one worker per core);
- `inference_lab.executors.ray_backend.RayExecutor`: Ray tasks on a cluster (the ``ray``
  extra).

Who uses it: the planner (`inference_lab.plan`: one job is a simulation at one rate) and
the sharded simulator (`inference_lab.sim.fleet`: one job is a shard of a deployment's
replicas).

Rule 1: `results()` yields `(job, outcome)` for every job submitted, exactly once, as
        they complete; the caller may submit more while iterating, and the iteration ends
        when nothing is left. An outcome is what `run` returned, or a `JobFailure` when
        the job could not produce one (it raised, or its worker died `max_attempts` times).
Rule 2: a worker that dies (``kill -9``, out of memory) costs a retry, not the caller's
        work: the process pool, broken by the death, is replaced and every job it held and
        had not answered is submitted again to the new pool (Ray retries its own tasks).
        Jobs are pure functions of their inputs (each caller's rule), so a retried job
        gives the same answer.
Rule 3: `close()` is idempotent and leaves no worker running, whatever state the
        executor is in (it is what a Ctrl-C runs); pool workers ignore SIGINT, so only
        the caller's process decides what an interrupt does.
Rule 4: this package imports nothing of ``inference_lab``: the jobs and their function
        are the caller's.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Generic, Protocol, TypeVar

import attrs

__all__ = [
    "Executor",
    "ExecutorStatistics",
    "InlineExecutor",
    "JobFailure",
    "KeyedJob",
    "ProcessExecutor",
    "default_workers",
]


@attrs.frozen
class JobFailure:
    """A job that produced no result (Rule 1), and why: the planner reports its candidate
    with `message` and never caches it; the sharded simulator fails the run with it."""

    message: str


class KeyedJob(Protocol):
    """What an executor needs of a job: a key naming its inputs (retries are counted by
    it)."""

    @property
    def key(self) -> str: ...


J = TypeVar("J", bound=KeyedJob)
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


@attrs.frozen(kw_only=True)
class ExecutorStatistics:
    """Counters of an executor: jobs submitted and answered, jobs run again after their
    worker died, pools replaced."""

    submitted: int
    completed: int
    retried: int
    restarts: int


class Executor(Protocol[J, R_co]):
    """The interface the planner and the sharded simulator use (module docstring)."""

    @property
    def parallelism(self) -> int:
        """How many jobs run at once (the planner keeps about twice as many queued)."""
        ...

    def submit(self, job: J) -> None: ...

    def results(self) -> Iterator[tuple[J, R_co | JobFailure]]: ...

    def close(self) -> None: ...

    def statistics(self) -> ExecutorStatistics: ...


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".rstrip(": ")


class InlineExecutor(Generic[J, R]):
    """Runs ``run`` on each job in this process when `results()` reaches it (submission
    order)."""

    parallelism = 1

    def __init__(self, run: Callable[[J], R]) -> None:
        self._run = run
        self._queue: deque[J] = deque()
        self._submitted = 0
        self._completed = 0

    def submit(self, job: J) -> None:
        self._queue.append(job)
        self._submitted += 1

    def results(self) -> Iterator[tuple[J, R | JobFailure]]:
        while self._queue:
            job = self._queue.popleft()
            outcome: R | JobFailure
            try:
                outcome = self._run(job)
            except Exception as exc:  # noqa: BLE001 - a bug in one job fails that job only
                outcome = JobFailure(_describe(exc))
            self._completed += 1
            yield job, outcome

    def close(self) -> None:
        self._queue.clear()

    def statistics(self) -> ExecutorStatistics:
        return ExecutorStatistics(
            submitted=self._submitted, completed=self._completed, retried=0, restarts=0
        )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class ProcessExecutor(Generic[J, R]):
    """``run`` on a local process pool (``spawn`` start method) with Rule 2's recovery."""

    def __init__(
        self, run: Callable[[J], R], workers: int | None = None, max_attempts: int = 4
    ) -> None:
        self._run = run
        self.workers = workers if workers is not None else default_workers()
        self.max_attempts = max_attempts
        self._context = multiprocessing.get_context("spawn")
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict[Future[R], J] = {}
        self._stranded: list[J] = []  # submitted while the pool was broken: not yet sent
        self._attempts: dict[str, int] = {}
        self._submitted = 0
        self._completed = 0
        self._retried = 0
        self._restarts = 0

    @property
    def parallelism(self) -> int:
        return self.workers

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=self._context, initializer=_ignore_sigint
            )
        return self._pool

    def worker_pids(self) -> list[int]:
        """The pids of the current pool's workers (tests kill one)."""
        procs = getattr(self._pool, "_processes", None) or {}
        return [p.pid for p in procs.values() if p.pid is not None]

    def _send(self, job: J) -> None:
        try:
            future = self._ensure_pool().submit(self._run, job)
        except BrokenProcessPool:  # a worker died since `results` last looked
            self._stranded.append(job)
            return
        self._attempts[job.key] = self._attempts.get(job.key, 0) + 1
        self._futures[future] = job

    def submit(self, job: J) -> None:
        self._submitted += 1
        self._send(job)

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)

    def results(self) -> Iterator[tuple[J, R | JobFailure]]:
        while self._futures or self._stranded:
            if self._stranded:
                yield from self._recover()
                continue
            done, _ = wait(list(self._futures), return_when=FIRST_COMPLETED)
            broken = False
            for fut in done:
                job = self._futures.pop(fut)
                try:
                    outcome: R | JobFailure = fut.result()
                except BrokenProcessPool:
                    broken = True
                    self._futures[fut] = job  # handled with the others below
                    continue
                except Exception as exc:  # noqa: BLE001 - a bug in one job fails that job
                    outcome = JobFailure(_describe(exc))
                self._completed += 1
                self._attempts.pop(job.key, None)
                yield job, outcome
            if broken:
                yield from self._recover()

    def _recover(self) -> Iterator[tuple[J, R | JobFailure]]:
        """Rule 2: answer what the broken pool finished, run the rest on a new pool."""
        pending = list(self._futures.items())
        stranded, self._stranded = self._stranded, []
        self._futures.clear()
        self._kill_pool()
        self._restarts += 1
        for job in stranded:
            self._send(job)
        for fut, job in pending:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._completed += 1
                self._attempts.pop(job.key, None)
                yield job, fut.result()
            elif self._attempts.get(job.key, 0) >= self.max_attempts:
                self._completed += 1
                self._attempts.pop(job.key, None)
                yield job, JobFailure(f"its worker died {self.max_attempts} times running it")
            else:
                self._retried += 1
                self._send(job)

    def close(self) -> None:
        for fut in self._futures:
            fut.cancel()
        self._futures.clear()
        self._stranded.clear()
        self._kill_pool()

    def statistics(self) -> ExecutorStatistics:
        return ExecutorStatistics(
            submitted=self._submitted,
            completed=self._completed,
            retried=self._retried,
            restarts=self._restarts,
        )
