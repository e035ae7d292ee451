"""Ray tasks as a planning backend (the ``ray`` extra): `RayExecutor`.

Rule 1: each job is one Ray task running `jobs.run_job`; the job carries its resolved
        deployment and workload (jobs.py Rule 1), so the spec's files travel inside the
        task's arguments and a worker on another machine opens no file. The workers need
        this package at the planner's version (``pip install inference-lab`` on each
        node): the code version is in every job's key, not shipped.
Rule 2: a task whose worker process dies is retried by Ray itself (``max_retries``); one
        that still fails is a `JobFailure`, like a job that raises.
Rule 3: `ray` is imported only when a `RayExecutor` is made; ``ray.init`` is called with
        ``"local"`` (a private single-node instance for this plan), ``"auto"`` (the
        cluster this machine belongs to) or an address (``host:port`` or ``ray://...``),
        and ``ray.shutdown`` on `close` only when this executor connected.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from inference_lab.plan.backends import ExecutorStatistics, JobFailure, Outcome
from inference_lab.plan.jobs import Job, ProbeResult, run_job

__all__ = ["RayExecutor"]


class RayExecutor:
    """Jobs as Ray tasks (the module's Rules)."""

    def __init__(self, address: str, *, max_retries: int = 3, num_cpus: int | None = None) -> None:
        import ray

        self._ray: Any = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": False}
            if address == "local":
                kwargs.update(num_cpus=num_cpus, include_dashboard=False)
            else:
                kwargs["address"] = address
            ray.init(**kwargs)
        self._task = ray.remote(num_cpus=1, max_retries=max_retries)(run_job)
        self._refs: dict[Any, Job] = {}
        self._submitted = 0
        self._completed = 0

    @property
    def parallelism(self) -> int:
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    def submit(self, job: Job) -> None:
        self._refs[self._task.remote(job)] = job
        self._submitted += 1

    def results(self) -> Iterator[tuple[Job, Outcome]]:
        ray = self._ray
        while self._refs:
            ready, _ = ray.wait(list(self._refs), num_returns=1)
            for ref in ready:
                job = self._refs.pop(ref)
                outcome: Outcome
                try:
                    result = ray.get(ref)
                    outcome = (
                        result if isinstance(result, ProbeResult) else JobFailure(repr(result))
                    )
                except Exception as exc:  # noqa: BLE001 - RayTaskError, WorkerCrashedError, ...
                    lines = str(exc).strip().splitlines()
                    outcome = JobFailure(f"{type(exc).__name__}: {lines[-1] if lines else ''}")
                self._completed += 1
                yield job, outcome

    def close(self) -> None:
        ray = self._ray
        for ref in list(self._refs):
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001, S110 - a task that already finished
                pass
        self._refs.clear()
        if self._owns and ray.is_initialized():
            ray.shutdown()
        self._owns = False

    def statistics(self) -> ExecutorStatistics:
        return ExecutorStatistics(
            submitted=self._submitted, completed=self._completed, retried=0, restarts=0
        )
