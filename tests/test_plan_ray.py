"""The Ray backend on a real local cluster of two nodes: a head and a second node, each a
raylet process of its own with one CPU, every process bound to 127.0.0.1.

The cluster is started with Ray's own ``ray.cluster_utils.Cluster`` (the tool Ray's
multi-node tests use: each ``add_node`` starts a real raylet joined to the head's GCS), under
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, without which Ray replaces 127.0.0.1 by the
machine's outward address and listens on every interface. Teardown stops the driver and
both nodes, then kills by pid any process still running from the cluster's private
temporary directory, whatever the test did. The two tests take about 30 s together.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inference_lab import cli
from inference_lab.plan.backends import InlineExecutor
from inference_lab.plan.cache import ResultCache
from inference_lab.plan.planner import PlanProgress, run_plan
from inference_lab.plan.spec import expand_candidates, load_spec
from tests.plan_util import SPEC, answer, write_spec

_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def _pids_under(temp: str) -> list[int]:
    """Processes whose command line names the cluster's temporary directory (every Ray
    process of it does: the raylets, the GCS, the workers)."""
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


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    import ray
    from ray.cluster_utils import Cluster

    # A short path: Ray's Unix sockets live under it (108-byte limit).
    temp = tempfile.mkdtemp(prefix="il-ray-", dir="/tmp")
    Path("/tmp/ray").mkdir(exist_ok=True)  # Cluster notes the head's address there
    node = {
        "node_ip_address": "127.0.0.1",
        "num_cpus": 1,
        "object_store_memory": 80 * 2**20,
        "temp_dir": temp,
    }
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        cluster.add_node(**node)
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for pid in _pids_under(temp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_a_plan_on_two_ray_nodes_survives_a_killed_worker(ray_cluster: Any, tmp_path: Path) -> None:
    """The small plan as Ray tasks over both nodes; after the first result, the worker
    process that produced it gets SIGKILL. Ray runs its task again, and the answer is
    exactly the in-process backend's."""
    import ray

    from inference_lab.plan.ray_backend import RayExecutor

    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 2 and {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}
    spec_path = write_spec(tmp_path)
    spec = load_spec(spec_path)
    inline = run_plan(
        spec, expand_candidates(spec), InlineExecutor(), ResultCache(tmp_path / "inline")
    )

    executor = RayExecutor(ray_cluster.address)
    assert executor.parallelism == 2
    cache = ResultCache(tmp_path / "ray")
    killed: list[int] = []

    def kill_a_worker(p: PlanProgress) -> None:
        if p.jobs_run >= 1 and not killed:
            (entry,) = [cache.get(f.stem) for f in (tmp_path / "ray").glob("*/*.npz")]
            assert entry is not None
            pid = int(entry.worker.rsplit(":", 1)[1])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    try:
        result = run_plan(spec, expand_candidates(spec), executor, cache, progress=kill_a_worker)
    finally:
        executor.close()
    assert killed and answer(result) == answer(inline)
    assert result.jobs_failed == 0
    workers = {cache.get(f.stem).worker for f in (tmp_path / "ray").glob("*/*.npz")}  # type: ignore[union-attr]
    assert len(workers) >= 2  # both nodes' workers ran jobs
    assert ray.is_initialized()  # the executor did not own the connection: left open


def test_the_command_runs_on_a_ray_address(
    ray_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inference-lab plan SPEC --ray ADDRESS`` runs the plan on the cluster and reports
    the same cheapest candidates as ``--inline``."""
    one = SPEC.replace('hardware = ["h100", "b200"]', 'hardware = ["h100"]')
    spec = write_spec(tmp_path, one)
    argv = ["plan", str(spec), "-q", "--no-progress"]
    assert cli.main([*argv, "-o", str(tmp_path / "ray"), "--ray", ray_cluster.address]) == 0
    on_ray = capsys.readouterr().out
    assert cli.main([*argv, "-o", str(tmp_path / "inline"), "--inline"]) == 0
    assert on_ray == capsys.readouterr().out and "cheapest for tight" in on_ray
