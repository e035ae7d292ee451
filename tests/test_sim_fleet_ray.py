"""A sharded simulation on a real local Ray cluster of two nodes (a head and a second
raylet, one CPU each, every process on 127.0.0.1: ``executors.ray_backend.local_cluster``,
which kills whatever the cluster left when the module ends). The shards run as Ray tasks
on both nodes and merge to exactly what the in-process executor merges; the command
``sim --ray ADDRESS`` reports the same. Skipped, with the reason, where Ray is not
installed. About 30 s, the cluster's start included."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from inference_lab import cli
from inference_lab.core.config import load_deployment, load_workload
from inference_lab.executors.backends import InlineExecutor
from inference_lab.sim.fleet import run_fleet, shard_jobs
from inference_lab.sim.shard import ShardResult, run_shard, shard_deployment
from tests.configs_util import GPT_OSS_20B, WORKLOADS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed (pip install 'inference-lab[ray]')",
)

DEPLOYMENT = shard_deployment(load_deployment(GPT_OSS_20B, "b200"), 4)
MIX = attrs.evolve(
    load_workload(WORKLOADS / "poisson-50rps-4000.toml"), arrival_rate=200.0, num_requests=1_200
)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    from inference_lab.executors.ray_backend import local_cluster

    with local_cluster(nodes=2) as address:
        yield address


def _answer(doc: dict[str, Any]) -> dict[str, Any]:
    """A result's JSON without what says how it ran (wall times, parallelism)."""
    out = dict(doc)
    out["time"] = {"simulated_s": doc["time"]["simulated_s"]}
    out["fleet"] = {k: v for k, v in doc["fleet"].items() if k not in ("shards_ran", "parallelism")}
    return out


def _figures(r: ShardResult) -> dict[str, Any]:
    """A shard's answer: every field but how and where it ran, the sketches by bucket."""
    out = {k: v for k, v in attrs.asdict(r, recurse=False).items() if k != "timing"}
    out["latencies"] = {
        name: [b.tolist() if hasattr(b, "tolist") else b for b in sketch.buckets()]
        for name, sketch in r.latencies.items()
    }
    return out


def test_shards_on_two_ray_nodes_merge_to_the_in_process_answer(ray_cluster: str) -> None:
    """Four shards as Ray tasks on the two-node cluster (both nodes' CPUs counted): each
    shard's result is the in-process one (jobs are pure), run in a Ray worker process,
    and the merge is identical. Which workers Ray picks is its own choice: shards of
    50 ms may all land on the first worker free, so that is not asserted."""
    from inference_lab.executors.ray_backend import RayExecutor

    executor = RayExecutor(run_shard, ray_cluster)
    assert executor.parallelism == 2
    try:
        for job in shard_jobs(DEPLOYMENT, MIX, MIX.seed, 4):
            executor.submit(job)
        results = {job.key: outcome for job, outcome in executor.results()}
        on_ray = run_fleet(DEPLOYMENT, MIX, executor, shards=4)
    finally:
        executor.close()
    jobs = {job.key: job for job in shard_jobs(DEPLOYMENT, MIX, MIX.seed, 4)}
    hosts = set()
    for key, remote in results.items():
        assert isinstance(remote, ShardResult), remote
        hosts.add(remote.timing.host)
        here = run_shard(jobs[key])
        assert _figures(remote) == _figures(here)
    assert len(results) == 4 and os.getpid() not in {int(h.rsplit(":", 1)[1]) for h in hosts}
    inline = run_fleet(DEPLOYMENT, MIX, InlineExecutor(run_shard), shards=4)
    assert _answer(on_ray.to_dict()) == _answer(inline.to_dict())
    assert on_ray.summary.requests_completed == MIX.num_requests


def test_the_command_runs_on_a_ray_address(
    ray_cluster: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sim --ray ADDRESS --replicas 4 --shards 3``: the summary and the JSON of the
    in-process shards, with the sharded line."""
    workload = tmp_path / "mix.toml"
    workload.write_text(
        'arrival_pattern = "poisson"\narrival_rate = 200.0\nnum_requests = 1200\n'
        'input_len_dist = { type = "lognormal", mean = 6.9, std_dev = 0.7 }\n'
        'output_len_dist = { type = "lognormal", mean = 5.3, std_dev = 0.8 }\nseed = 42\n'
    )
    argv = ["sim", "--config", str(GPT_OSS_20B), "--hardware", "b200", "--replicas", "4"]
    argv += ["--workload", str(workload), "-q", "-o", str(tmp_path / "r.json")]
    assert cli.main([*argv, "--ray", ray_cluster, "--shards", "3"]) == 0
    out = capsys.readouterr().out
    assert "sharded      4 replicas in 3 shards, 2 at a time" in out
    assert "1,200 completed" in out
    inline = run_fleet(DEPLOYMENT, MIX, InlineExecutor(run_shard), shards=3)
    doc = json.loads((tmp_path / "r.json").read_text())
    doc.pop("config")
    assert _answer(doc) == _answer(json.loads(json.dumps(inline.to_dict())))
