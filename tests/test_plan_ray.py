"""The Ray backend on a real local cluster of two nodes: a head and a second node, each a
raylet process of its own with one CPU, every process bound to 127.0.0.1
(``ray_backend.local_cluster``: Ray's own ``ray.cluster_utils.Cluster``, each node joined
to the head's GCS). Teardown stops the driver and both nodes, then kills by pid any
process still running from the cluster's private temporary directory, whatever the test
did. The third test runs ``--ray local`` in a fresh interpreter, the fourth the
documented ``ray start`` recipe with a token. The four take about 90 s together, the
clusters' starts included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference_lab import cli
from inference_lab.executors.backends import InlineExecutor
from inference_lab.executors.ray_backend import RayExecutor, local_cluster
from inference_lab.plan.cache import ResultCache
from inference_lab.plan.jobs import run_job
from inference_lab.plan.planner import PlanProgress, run_plan
from inference_lab.plan.spec import expand_candidates, load_spec
from tests.plan_util import SPEC, answer, write_spec


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    with local_cluster(nodes=2) as address:
        yield address


_LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _family(pid: int) -> set[int]:
    """`pid` and every process descended from it."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    family = {pid}
    grew = True
    while grew:
        new = {child for child, ppid in parent.items() if ppid in family} - family
        family |= new
        grew = bool(new)
    return family


def _listening_addresses(pids: set[int]) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) of the TCP sockets that
    `pids` listen on."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                out.add(fields[1].split(":")[0])
    return out


def test_every_process_of_the_cluster_listens_on_loopback_only(ray_cluster: str) -> None:
    """The head, the second node, their workers and this driver listen on 127.0.0.1 (or
    ::1) only, never on every interface."""
    import ray

    @ray.remote(num_cpus=1)
    def pid() -> int:
        return os.getpid()

    assert ray.get([pid.remote() for _ in range(4)])  # workers started on both nodes
    addresses = _listening_addresses(_family(os.getpid()))
    assert addresses and addresses <= _LOOPBACK, addresses


def test_a_plan_on_two_ray_nodes_survives_a_killed_worker(ray_cluster: str, tmp_path: Path) -> None:
    """The small plan as Ray tasks over both nodes; as soon as a worker that has returned a
    result is running another task, it gets SIGKILL mid-task. Ray runs that task again, and
    the answer is exactly the in-process backend's."""
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 2 and {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}
    spec_path = write_spec(tmp_path)
    spec = load_spec(spec_path)
    inline = run_plan(
        spec, expand_candidates(spec), InlineExecutor(run_job), ResultCache(tmp_path / "inline")
    )

    executor = RayExecutor(run_job, ray_cluster)
    assert executor.parallelism == 2
    cache = ResultCache(tmp_path / "ray")
    killed: list[int] = []

    def busy(pid: int) -> bool:
        """Whether Ray worker `pid` is running a task now (Ray titles a worker after the
        task it runs, ``ray::IDLE`` between tasks)."""
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::run_job")
        except OSError:
            return False

    def kill_a_busy_worker(p: PlanProgress) -> None:
        if killed or p.jobs_run < 1:
            return
        entries = [cache.get(f.stem) for f in (tmp_path / "ray").glob("*/*.npz")]
        pids = {int(e.worker.rsplit(":", 1)[1]) for e in entries if e is not None}
        for pid in sorted(pids):
            if busy(pid):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return

    try:
        result = run_plan(
            spec, expand_candidates(spec), executor, cache, progress=kill_a_busy_worker
        )
    finally:
        executor.close()
    assert killed and answer(result) == answer(inline)
    assert result.jobs_failed == 0
    entries = [cache.get(f.stem) for f in (tmp_path / "ray").glob("*/*.npz")]
    workers = {e.worker for e in entries if e is not None}
    assert len(workers) >= 2  # both nodes' workers ran jobs
    assert ray.is_initialized()  # the executor did not own the connection: left open


def test_the_command_runs_on_a_ray_address(
    ray_cluster: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inference-lab plan SPEC --ray ADDRESS`` runs the plan on the cluster and reports
    the same cheapest candidates as ``--inline``."""
    one = SPEC.replace('hardware = ["h100", "b200"]', 'hardware = ["h100"]')
    spec = write_spec(tmp_path, one)
    argv = ["plan", str(spec), "-q", "--no-progress"]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "ray"), "--ray", ray_cluster]) == 0
    on_ray = capsys.readouterr().out
    assert cli.main([*argv, "--out-dir", str(tmp_path / "inline"), "--inline"]) == 0
    assert on_ray == capsys.readouterr().out and "cheapest for tight" in on_ray


def test_ray_local_starts_a_private_instance(tmp_path: Path) -> None:
    """``--ray local`` (in a fresh interpreter, as a user runs it) starts its own Ray
    instance, plans on it, stops it, and reports what ``--inline`` reports."""
    one = SPEC.replace('hardware = ["h100", "b200"]', 'hardware = ["h100"]')
    spec = write_spec(tmp_path, one)

    # Ray >= 2.59 writes a token to ~/.ray/auth_token for a local instance: a home of its
    # own, so the test leaves none in the user's (docs/planning.md, tokens)
    env = dict(os.environ, HOME=str(tmp_path))

    def plan_with(*flags: str) -> str:
        argv = [sys.executable, "-m", "inference_lab.cli", "plan", str(spec), "-q", *flags]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    on_ray = plan_with("--out-dir", str(tmp_path / "ray"), "--ray", "local")
    assert on_ray == plan_with("--out-dir", str(tmp_path / "inline"), "--inline")
    assert "cheapest for tight" in on_ray


def _ray_script() -> Path:
    """The ``ray`` command of this environment (skip the test without it)."""
    pytest.importorskip("ray", reason="Ray is not installed (the ray extra)")
    script = Path(sys.executable).with_name("ray")
    if not script.is_file():
        pytest.skip(f"no ray command beside {sys.executable}")
    return script


def _kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment holds ``marker`` (``NAME=value``): the
    processes a test's ``ray start`` left, found by what only they inherited."""
    needle = marker.encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def test_the_documented_two_node_recipe_runs_with_a_token(tmp_path: Path) -> None:
    """docs/planning.md's recipe, with Ray's own commands, as three machines would run it
    (three home directories): on the head, ``RAY_AUTH_MODE=token``, ``ray get-auth-token
    --generate`` (the token in ~/.ray/auth_token) and ``ray start --head``; on the second
    node the token file copied to its ~/.ray/auth_token and ``ray start --address``; the
    driver with the token in ``RAY_AUTH_TOKEN`` only, ``inference-lab plan --ray
    HEAD:PORT``, which plans on both nodes (2 workers) and answers as ``--inline`` does.

    "HEAD" is 127.0.0.2, a loopback address Ray does not rewrite to the machine's outward
    one (it rewrites 127.0.0.1); ``ray start`` binds its GCS and raylets on every
    interface, as on a real cluster, so every RPC here is token-authenticated. Teardown
    kills by pid every process that inherited the test's marker variable."""
    ray = _ray_script()
    marker = f"INFERENCE_LAB_RAY_RECIPE={os.getpid()}-{tmp_path.name}"
    temp = tempfile.mkdtemp(prefix="il-ray-", dir="/tmp")  # Ray's sockets: a short path
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    head = f"127.0.0.2:{port}"
    homes = {name: tmp_path / name for name in ("head", "node", "driver")}
    for home in homes.values():
        home.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    base.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token")
    name, _, value = marker.partition("=")
    base[name] = value

    def run(argv: list[str], home: str, timeout: float = 120, **extra: str) -> str:
        env = dict(base, HOME=str(homes[home]), **extra)
        proc = subprocess.run(
            argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, (argv, proc.stdout[-1500:], proc.stderr[-1500:])
        return proc.stdout

    one = SPEC.replace('hardware = ["h100", "b200"]', 'hardware = ["h100"]')
    spec = write_spec(tmp_path, one)
    plan = [sys.executable, "-m", "inference_lab.cli", "plan", str(spec), "-q", "--no-progress"]
    try:
        token = run([str(ray), "get-auth-token", "--generate"], "head").strip()
        token_file = homes["head"] / ".ray" / "auth_token"
        assert token and token_file.read_text().strip() == token
        node = [f"--node-ip-address={head.split(':')[0]}", "--num-cpus=1", "--disable-usage-stats"]
        run([str(ray), "start", "--head", f"--port={port}", f"--temp-dir={temp}",
             "--include-dashboard=false", *node], "head")  # fmt: skip
        (homes["node"] / ".ray").mkdir()
        shutil.copy(token_file, homes["node"] / ".ray" / "auth_token")  # scp, on machines
        run([str(ray), "start", f"--address={head}", *node], "node")
        on_ray = subprocess.run(
            [*plan, "--out-dir", str(tmp_path / "ray"), "--ray", head],
            env=dict(base, HOME=str(homes["driver"]), RAY_AUTH_TOKEN=token),
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert on_ray.returncode == 0, on_ray.stderr[-2000:]
        assert " on 2 workers" in on_ray.stderr  # both nodes' CPUs
        inline = run([*plan, "--out-dir", str(tmp_path / "inline"), "--inline"], "driver")
        assert on_ray.stdout == inline and "cheapest for tight" in inline
    finally:
        _kill_marked(marker)
        shutil.rmtree(temp, ignore_errors=True)
