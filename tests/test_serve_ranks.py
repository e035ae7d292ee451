"""``serve --data-parallel-size N``: rank processes under a supervising parent
(``serve/ranks.py``), each rank's engine labels, KV-event ports and ranks, and seeds.

The in-process tests check what a rank's settings change; the process tests start real
parents (``python -m inference_lab.cli serve``) on loopback ports and check the banner,
the restart of a killed rank, the drain on SIGTERM, Ctrl-C, a killed parent and a rank
that cannot bind -- each time that no rank process is left behind.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import pytest
import zmq

from inference_lab.cli import main
from inference_lab.core.engine import BlockStored
from inference_lab.serve import ServeState
from inference_lab.serve.kv_events import KVEventsHub, KVEventsSettings, rank_endpoint
from inference_lab.serve.ranks import RankError, plan_ports

from .conftest import GPT, ROOT, ServeFactory, make_settings
from .test_serve_kv_events import decode_exact

CONFIG = str(ROOT / "configs" / "gpt-oss-20b.toml")


def ranked(settings: Any, rank: int, size: int) -> Any:
    return attrs.evolve(settings, data_parallel_rank=rank, data_parallel_size=size)


def replicated(settings: Any, replicas: int) -> Any:
    dep = settings.deployments[0]
    dep = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, replicas=replicas))
    return attrs.evolve(settings, deployments=(dep,))


# -- a rank's settings ------------------------------------------------------------------------


@pytest.mark.parametrize(("rank", "replicas", "engines"), [(1, 1, {"1"}), (1, 2, {"2", "3"})])
async def test_a_ranks_engine_labels_start_at_rank_times_workers(
    serve: ServeFactory, rank: int, replicas: int, engines: set[str]
) -> None:
    """vLLM's rank r labels its engine core ``engine="r"``; with several replicas per rank
    the global index is rank x replicas + replica, on every per-engine family."""
    settings = ranked(replicated(make_settings(), replicas), rank, 2)
    async with serve(settings) as s:
        response = await s.client.get("/metrics")
        text = (await response.get_data()).decode()
    found = set(re.findall(r'engine="(\d+)"', text))
    assert found == engines
    assert f'vllm:num_requests_running{{engine="{min(engines)}",model_name="{GPT}"}}' in text
    assert "vllm:cache_config_info{" in text and f'engine="{min(engines)}"' in text


def test_rank_endpoints_follow_vllms_offset_rule() -> None:
    """vLLM's ``offset_endpoint_port``: a TCP port + the rank, an inproc name + ``_dp<r>``;
    the k-th published model's ranks come after the (k-1)-th's."""
    assert rank_endpoint("tcp://*:5557", 0, 0, 2) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 0, 1, 2) == "tcp://*:5558"
    assert rank_endpoint("tcp://127.0.0.1:5557", 1, 1, 2) == "tcp://127.0.0.1:5560"
    assert rank_endpoint("tcp://127.0.0.1:*", 1, 1, 2) == "tcp://127.0.0.1:*"
    assert rank_endpoint("inproc://kv", 0, 1, 2) == "inproc://kv_dp1"
    assert rank_endpoint("ipc:///tmp/kv", 1, 1, 3) == "ipc:///tmp/kv_1_dp1"
    assert rank_endpoint("ipc:///tmp/kv", 1, 0, 3) == "ipc:///tmp/kv_1"


def test_a_ranks_batches_carry_its_rank_on_its_port() -> None:
    """Rank 1 of 2, two replicas each: its publisher connects to the endpoint's port + 1
    and its batches, decoded with vLLM's declarations, say data-parallel rank 2 + replica."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    settings = replicated(make_settings(), 2)
    kv = KVEventsSettings(endpoint=f"tcp://127.0.0.1:{port - 1}")
    hub = KVEventsHub(kv, settings.deployments, rank=1, ranks=2)
    try:
        publisher = hub.publishers[GPT]
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        hub.start()
        ranks: set[int] = set()
        deadline = time.monotonic() + 20
        while ranks != {2, 3}:  # a PUB drops what it sends before the connect completes
            assert time.monotonic() < deadline, ranks
            publisher.publish(
                (
                    BlockStored(worker=0, block_hashes=(1,), parent_block_hash=None),
                    BlockStored(worker=1, block_hashes=(2,), parent_block_hash=None),
                )
            )
            try:
                while True:
                    frames = sub.recv_multipart()
                    rank = decode_exact(frames[2]).data_parallel_rank
                    assert rank is not None
                    ranks.add(rank)
            except zmq.Again:
                pass
    finally:
        hub.close()
        sub.close(linger=0)
        ctx.destroy(linger=0)


def test_ranks_draw_different_answer_lengths_and_rank_0_is_the_single_server() -> None:
    """Each rank's length generator is seeded with the seed + its rank: ranks are not
    clones of each other, and rank 0 draws what one server draws."""
    settings = make_settings(run_to_max_tokens=False, seed=7)

    def draws(s: Any) -> list[int]:
        runtime = ServeState.build(s).runtimes[GPT]
        return [int(x) for x in runtime._output_lengths.sample(runtime._rng, 8)]

    single = draws(settings)
    assert draws(ranked(settings, 0, 2)) == single
    assert draws(ranked(settings, 1, 2)) != single


# -- ports and flags --------------------------------------------------------------------------


def test_a_taken_port_in_the_range_is_named() -> None:
    base = plan_ports("127.0.0.1", 0, 3)[0].port  # three free ports; the middle one taken
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        with pytest.raises(
            RankError, match=rf"^port {base + 1} \(rank 1 of --data-parallel-size 3\)"
        ):
            plan_ports("127.0.0.1", base, 3)


def test_port_0_takes_free_consecutive_ports() -> None:
    ports = plan_ports("127.0.0.1", 0, 3)
    assert [p.rank for p in ports] == [0, 1, 2]
    assert [p.port - ports[0].port for p in ports] == [0, 1, 2]


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (
            ["--data-parallel-size", "0"],
            2,
            "argument --data-parallel-size: must be an integer >= 1, got 0",
        ),
        (
            ["--port", "65535", "--data-parallel-size", "2"],
            1,
            "--port 65535 with --data-parallel-size 2 needs ports up to 65536, past 65535",
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-rank", "2"],
            1,
            "--data-parallel-rank 2 is not below --data-parallel-size 2",
        ),
    ],
)
def test_bad_rank_flags_are_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], code: int, message: str
) -> None:
    assert main(["serve", "--config", CONFIG, *flags]) == code
    out, err = capsys.readouterr()
    assert out == "" and err == f"inference-lab serve: error: {message}\n"


def test_a_taken_port_starts_no_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """Rule 1: the ports are tried before any rank starts; the line names the port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = _children()
        code = main(["serve", "--config", CONFIG, "--port", str(port), "--data-parallel-size", "2"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert re.fullmatch(
        rf"inference-lab serve: error: port {port} \(rank 0 of --data-parallel-size 2\) is "
        r"not free on 127\.0\.0\.1: .+\n",
        err,
    )
    assert _children() == before


# -- real processes ---------------------------------------------------------------------------


def _children() -> set[int]:
    """The pids of this process's live children."""
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Fleet:
    """``inference-lab serve --data-parallel-size N`` in a subprocess: its banner's URLs
    and pids, its stderr lines as they come."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "inference_lab.cli", "serve", "--config", CONFIG]
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_LAB_")}
        self.proc = subprocess.Popen(
            [*cmd, "--port", "0", *flags],
            cwd=ROOT,
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.err: queue.Queue[str] = queue.Queue()
        self.out: queue.Queue[str] = queue.Queue()
        self.pumps = []
        for stream, lines in ((self.proc.stderr, self.err), (self.proc.stdout, self.out)):
            pump = threading.Thread(target=_pump, args=(stream, lines), daemon=True)
            pump.start()
            self.pumps.append(pump)
        self.urls: list[str] = []
        self.pids: list[int] = []

    def banner(self, timeout: float = 90) -> str:
        seen = []
        while True:
            line = self.out.get(timeout=timeout)
            seen.append(line)
            if line.startswith("listening on "):
                break
        text = "".join(seen)
        self.urls = re.findall(r"rank \d+  (http://\S+)", text)
        self.pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", text)]
        return text

    def wait_stderr(self, pattern: str, timeout: float = 90) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            line = self.err.get(timeout=max(0.1, deadline - time.monotonic()))
            if match := re.search(pattern, line):
                return match

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _rank_processes() -> list[int]:
    """Every rank process of this worktree's interpreter on the machine."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[:3] == [sys.executable.encode(), b"-m", b"inference_lab.serve.ranks"]:
            found.append(int(entry.name))
    return found


def _pump(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _gone(pids: list[int], timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_ranks_serve_restart_and_drain_on_sigterm() -> None:
    """Two ranks on consecutive ports, each its own process with its own engine label; a
    killed rank is reported and restarted on its port while the other serves on;
    SIGTERM drains both and the parent exits 0 with no rank left."""
    fleet = Fleet("--data-parallel-size", "2")
    try:
        banner = fleet.banner()
        assert "data-parallel ranks: 2 processes" in banner, banner
        assert len(fleet.urls) == 2 and len(set(fleet.pids)) == 2
        ports = [int(u.rsplit(":", 1)[1]) for u in fleet.urls]
        assert ports[1] == ports[0] + 1
        assert banner.splitlines()[-1].startswith(f"listening on {fleet.urls[0]} {fleet.urls[1]}")
        for rank, url in enumerate(fleet.urls):
            assert _get(url + "/health")[0] == 200
            text = _get(url + "/metrics")[1].decode()
            assert set(re.findall(r'engine="(\d+)"', text)) == {str(rank)}
        assert fleet.pids[0] not in _children() and fleet.pids[1] not in _children()

        os.kill(fleet.pids[1], signal.SIGKILL)
        fleet.wait_stderr(
            rf"rank 1 \(pid {fleet.pids[1]}\) exited: killed by SIGKILL; restarting in 1 s"
        )
        assert _get(fleet.urls[0] + "/health")[0] == 200  # the other rank serves on
        match = fleet.wait_stderr(r"rank 1 restarted: (\S+) \(pid (\d+)\)")
        assert match.group(1) == fleet.urls[1]
        fleet.pids.append(int(match.group(2)))
        body = json.loads(_get(fleet.urls[1] + "/v1/models")[1])
        assert body["data"][0]["id"] == GPT

        fleet.proc.send_signal(signal.SIGTERM)
        assert fleet.proc.wait(timeout=60) == 0
        assert _gone(fleet.pids)
    finally:
        fleet.stop()


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_no_rank_outlives_the_parent(how: str) -> None:
    """Ctrl-C (SIGINT to the parent: the ranks, in sessions of their own, get it from the
    parent once) ends every rank; so does a parent killed outright (its pipe closes)."""
    fleet = Fleet("--data-parallel-size", "2")
    try:
        fleet.banner()
        if how == "sigint":
            fleet.proc.send_signal(signal.SIGINT)
            assert fleet.proc.wait(timeout=60) == 0
        else:
            fleet.proc.kill()
            fleet.proc.wait()
        assert _gone(fleet.pids), [p for p in fleet.pids if _alive(p)]
    finally:
        fleet.stop()


def test_a_rank_that_cannot_bind_fails_the_start(tmp_path: Path) -> None:
    """Rank 1's KV-event socket cannot be bound (its ipc path is a directory): the parent
    stops rank 0 and prints one line naming rank 1; exit 1, no rank left."""
    (tmp_path / "kv_dp1").mkdir()
    fleet = Fleet("--data-parallel-size", "2", "--kv-events-endpoint", f"ipc://{tmp_path / 'kv'}")
    try:
        code = fleet.proc.wait(timeout=90)
        for pump in fleet.pumps:
            pump.join(timeout=10)
        lines = list(fleet.err.queue)
        assert code == 1
        assert len(lines) == 1, lines
        assert (
            lines[0].startswith("inference-lab serve: error: rank 1 (port ")
            and "did not start: KV events of gpt-oss-20b: cannot use ipc://" in lines[0]
        ), lines
        assert fleet.out.empty()
        assert not [p for p in _rank_processes() if _alive(p)]
    finally:
        fleet.stop()
