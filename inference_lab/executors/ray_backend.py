"""Ray tasks as a backend of pure jobs (the ``ray`` extra): `RayExecutor`.

Rule 1: each job is one Ray task running the executor's function on it; a job carries
        everything it reads (the planner's resolved deployment and workload, a shard's
        deployment, workload and replicas), so the caller's files travel inside the
        task's arguments and a worker on another machine opens no file. The workers need
        this package at the caller's version (``pip install inference-lab`` on each
        node): the function is shipped by name, not by value.
Rule 2: a task whose worker process dies is retried by Ray itself (``max_retries``); one
        that still fails is a `JobFailure`, like a job that raises.
Rule 3: `ray` is imported only when a `RayExecutor` is made; ``ray.init`` is called with
        ``"local"`` (a private single-node instance for this run, listening on 127.0.0.1
        only), ``"auto"`` (the cluster this machine belongs to) or an address
        (``host:port`` or ``ray://...``), and ``ray.shutdown`` on `close` only when this
        executor connected.
Rule 4: `local_cluster` (tests, benchmarks) starts a cluster of several nodes on this
        machine whose every process listens on 127.0.0.1 only, and stops every one of
        them when it exits, however it exits.
Rule 5: an address with a port (``host:port``, ``ray://host:port``) is probed before
        ``ray.init`` (`probe_address`): a TCP connection to that port (the head's GCS,
        or a Ray client server) within a timeout, else `NoClusterThere`, one line naming
        the address. ``ray.init`` would keep retrying the GCS for a minute or more.
        ``local``, ``auto`` and an address without a port are left to Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic

from inference_lab.executors.backends import ExecutorStatistics, J, JobFailure, R

__all__ = ["PROBE_TIMEOUT_S", "NoClusterThere", "RayExecutor", "local_cluster", "probe_address"]

#: How long a ``--ray HOST:PORT`` waits for the cluster's port to accept (Rule 5).
PROBE_TIMEOUT_S = 5.0


class NoClusterThere(ConnectionError):
    """Nothing accepts a connection at a ``--ray`` address's port (Rule 5)."""


def probe_address(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`NoClusterThere`, one line naming ``address``, unless something
    accepts a TCP connection at its ``host:port`` within ``timeout`` seconds (Rule 5)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address in ("local", "auto") or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except TimeoutError:
        raise NoClusterThere(
            f"--ray {address}: no Ray cluster answers there (no connection within {timeout:g} s)"
        ) from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise NoClusterThere(f"--ray {address}: no Ray cluster answers there ({reason})") from None


#: Without it Ray replaces 127.0.0.1 by the machine's outward address and its servers
#: listen on every interface (it is read when ``ray`` is first imported).
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def _pids_under(temp: str) -> list[int]:
    """Processes whose command line names `temp`: the GCS, the raylets and their helpers of
    a cluster started with it as its temporary directory (a worker retitles itself
    ``ray::...``, and exits with its raylet)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if temp.encode() in cmdline:
            out.append(int(entry.name))
    return out


@contextlib.contextmanager
def local_cluster(
    nodes: int = 2, cpus_per_node: int = 1, object_store_bytes: int = 80 * 2**20
) -> Iterator[str]:
    """A Ray cluster of `nodes` nodes on this machine (Rule 4), this process connected to
    it as the driver; yields its address (``127.0.0.1:port``).

    Each node is a raylet process of its own (``ray.cluster_utils.Cluster``, the tool
    Ray's multi-node tests use), the first also the head. The environment variables of
    `_LOOPBACK_ENV` must be set before ``ray`` is first imported in this process; they are
    set here, so call this before anything else imports ``ray``."""
    saved = {k: os.environ.get(k) for k in _LOOPBACK_ENV}
    os.environ.update(_LOOPBACK_ENV)
    import ray as ray_module
    from ray.cluster_utils import Cluster

    ray: Any = ray_module  # partly typed: its calls are checked by the tests

    # A short path: Ray's Unix sockets live under it (a 108-byte limit).
    temp = tempfile.mkdtemp(prefix="il-ray-", dir="/tmp")
    # Cluster notes the head's address in <system temp>/ray/ray_current_cluster (for a
    # later ray.init()); the directory may not exist on a machine that never ran Ray.
    try:
        from ray._common.utils import get_default_ray_temp_dir

        note = Path(get_default_ray_temp_dir(), "ray_current_cluster")  # type: ignore[no-untyped-call]
    except ImportError:  # another Ray layout: its default
        note = Path(tempfile.gettempdir(), "ray", "ray_current_cluster")
    note.parent.mkdir(exist_ok=True)
    node: dict[str, Any] = {
        "node_ip_address": "127.0.0.1",
        "num_cpus": cpus_per_node,
        "object_store_memory": object_store_bytes,
        "temp_dir": temp,
    }
    cluster: Any = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        yield str(cluster.address)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for pid in _pids_under(temp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        with contextlib.suppress(OSError):
            if cluster is not None and note.read_text().strip() == cluster.address:
                note.unlink()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class RayExecutor(Generic[J, R]):
    """``run`` on each job as a Ray task (the module's Rules)."""

    def __init__(
        self,
        run: Callable[[J], R],
        address: str,
        *,
        max_retries: int = 3,
        num_cpus: int | None = None,
    ) -> None:
        if address == "local" and "ray" not in sys.modules:
            # a private instance listens on 127.0.0.1 only (read when ray is imported)
            for key, value in _LOOPBACK_ENV.items():
                os.environ.setdefault(key, value)
        import ray

        self._ray: Any = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            kwargs: dict[str, Any] = {
                "address": address,
                "logging_level": logging.WARNING,
                "log_to_driver": False,
            }
            if address == "local":  # results are tens of kB: a small object store will do
                kwargs.update(
                    num_cpus=num_cpus, include_dashboard=False, object_store_memory=256 * 2**20
                )
            ray.init(**kwargs)
        self._task = ray.remote(num_cpus=1, max_retries=max_retries)(run)
        self._refs: dict[Any, J] = {}
        self._submitted = 0
        self._completed = 0

    @property
    def parallelism(self) -> int:
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    def submit(self, job: J) -> None:
        self._refs[self._task.remote(job)] = job
        self._submitted += 1

    def results(self) -> Iterator[tuple[J, R | JobFailure]]:
        ray = self._ray
        while self._refs:
            ready, _ = ray.wait(list(self._refs), num_returns=1)
            for ref in ready:
                job = self._refs.pop(ref)
                outcome: R | JobFailure
                try:
                    outcome = ray.get(ref)
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
