"""A sharded simulation (``inference_lab.sim.fleet``, ``sim.shard``) against the same run
unsharded, with the in-process executor: every count, integer sum, extreme, rate, the
replicas' figures and the capacity verdict equal; means equal up to rounding;
percentiles within the sketch's relative bound; the peak queue an upper bound. And what
cannot be sharded is refused in one line."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from inference_lab import cli
from inference_lab.core.config import Deployment, Workload, load_deployment, load_workload, split_pd
from inference_lab.core.engine.router import draw
from inference_lab.errors import ConfigError, SimError
from inference_lab.executors.backends import InlineExecutor
from inference_lab.sim import shard_figures as shard_module
from inference_lab.sim.fleet import probe_address, run_fleet, run_on_ray, shard_jobs
from inference_lab.sim.run import SimResult, run_simulation
from inference_lab.sim.shard import ShardJob, ShardResult, run_shard, shard_deployment
from inference_lab.sim.sharding import draws, route
from inference_lab.sim.sketch import RELATIVE_ACCURACY
from inference_lab.traffic.traces import Trace, read_trace
from tests.configs_util import CONFIGS, GPT_OSS_20B, WORKLOADS

FRONTIER = CONFIGS / "frontier" / "DeepSeek-V3.toml"


def _gpt_oss(replicas: int) -> Deployment:
    return shard_deployment(load_deployment(GPT_OSS_20B, "b200"), replicas)


def _mix(**overrides: Any) -> Workload:
    """poisson-50rps-4000's lengths and seed with ``overrides``."""
    return attrs.evolve(load_workload(WORKLOADS / "poisson-50rps-4000.toml"), **overrides)


def _routed(dep: Deployment, router: str, seed: int = 0) -> Deployment:
    return attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, router=router, router_seed=seed))


def _scenarios() -> dict[str, tuple[Deployment, Workload, int]]:
    gpt = _gpt_oss(4)
    short = attrs.evolve(gpt, model=attrs.evolve(gpt.model, max_seq_len=1_400))
    dp = load_deployment(FRONTIER, "b200")  # 8 data-parallel attention ranks a replica
    dp = attrs.evolve(
        shard_deployment(dp, 3),
        speculative=None,
        acceptance_rates=(),
        scheduler=attrs.evolve(dp.scheduler, frontend_latency=0.002),
    )
    return {
        # four replicas at ~50/s each, in three uneven shards
        "poisson": (gpt, _mix(arrival_rate=200.0, num_requests=1_500), 3),
        # far beyond capacity: the queue grows, the verdict says so
        "over capacity": (gpt, _mix(arrival_rate=1_500.0, num_requests=2_500), 4),
        # every arrival at t = 0 (ties), a context limit that refuses some, one shard each
        "batched, refusals": (short, _mix(arrival_pattern="batched", num_requests=600), 4),
        # data-parallel ranks in lockstep, a frontend latency, uniform times, over capacity
        "dp ranks": (dp, _mix(arrival_pattern="uniform", arrival_rate=300.0, num_requests=900), 2),
        # random draws (uneven replicas), three shards
        "random": (_routed(gpt, "random", 3), _mix(arrival_rate=200.0, num_requests=1_500), 3),
        # session_affinity without sessions places as random does; refusals take no draw
        "session_affinity, refusals": (
            _routed(short, "session_affinity", 11),
            _mix(arrival_pattern="batched", num_requests=600),
            2,
        ),
        # random over data-parallel ranks (workers, not replicas), over capacity
        "random, dp ranks": (
            _routed(dp, "random", 5),
            _mix(arrival_pattern="uniform", arrival_rate=300.0, num_requests=900),
            3,
        ),
    }


SCENARIOS = _scenarios()


def _inline(dep: Deployment, wl: Workload | Trace, shards: int) -> SimResult:
    return run_fleet(dep, wl, InlineExecutor(run_shard), shards=shards)


def _approx_equal(path: str, want: Any, got: Any) -> None:
    """``got`` (sharded) against ``want`` (unsharded), field by field (module docstring)."""
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for key in want:
            _approx_equal(f"{path}.{key}", want[key], got[key])
        return
    if isinstance(want, list):
        assert len(got) == len(want), path
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            _approx_equal(f"{path}[{i}]", w, g)
        return
    last = path.rsplit(".", 1)[-1]
    if last in ("p50", "p90", "p95", "p99") and want is not None:
        assert got == pytest.approx(want, rel=RELATIVE_ACCURACY * (1 + 1e-9)), path
    elif last in ("mean", "kv_usage_mean", "flop_util_mean", "bw_util_mean"):
        assert got == pytest.approx(want, rel=1e-12), path
    else:
        assert got == want, path


def _same_answer(dep: Deployment, wl: Workload | Trace, shards: int) -> tuple[SimResult, Any]:
    """Run ``wl`` sharded and not; assert every figure equal (means up to rounding,
    percentiles within the sketch's bound, the peak queue an upper bound); return the
    sharded result and the unsharded JSON."""
    want = run_simulation(dep, wl).to_dict()
    result = _inline(dep, wl, shards)
    got = result.to_dict()
    assert result.fleet is not None and result.fleet.shards == shards
    fleet = got.pop("fleet")
    assert fleet["shards"] == shards and fleet["relative_accuracy"] == RELATIVE_ACCURACY
    for key in ("wall_s", "speedup"):
        want["time"].pop(key), got["time"].pop(key)
    assert got.pop("peak_waiting") >= want["peak_waiting"]
    _approx_equal("result", {k: v for k, v in want.items() if k != "peak_waiting"}, got)
    return result, want


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_sharded_run_is_the_unsharded_one(name: str) -> None:
    dep, wl, shards = SCENARIOS[name]
    want = run_simulation(dep, wl).to_dict()
    result = _inline(dep, wl, shards)
    got = result.to_dict()
    assert result.fleet is not None and result.fleet.shards == shards
    fleet = got.pop("fleet")
    assert fleet["shards"] == shards and fleet["relative_accuracy"] == RELATIVE_ACCURACY
    for key in ("wall_s", "speedup"):
        want["time"].pop(key), got["time"].pop(key)
    assert got.pop("peak_waiting") >= want.pop("peak_waiting")
    _approx_equal("result", want, got)
    if name in ("random", "random, dp ranks"):  # (the draws are uneven)
        counts = [r["requests"] for r in want["replicas"]]
        assert len(set(counts)) > 1 and min(counts) > 0
    if name in ("batched, refusals", "session_affinity, refusals"):
        assert want["requests"]["refused"] > 0
        assert result.fleet.refusals == (("max_seq_len", want["requests"]["refused"]),)
    if name in ("over capacity", "dp ranks"):
        assert want["capacity"]["over"] is True
        assert want["capacity"]["waiting_at_end"] > want["capacity"]["waiting_at_mid"] > 0


def test_the_answer_does_not_depend_on_the_shards_or_the_folds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One shard, two, or four, with records folded every 64 completions and 256 steps:
    the same counts, sums, extremes and verdict (the shards' sketches merge to the same
    buckets, so even the percentiles are equal)."""
    dep, wl, _ = SCENARIOS["poisson"]

    def run(shards: int) -> dict[str, Any]:
        doc = _inline(dep, wl, shards).to_dict()
        for key in ("time", "fleet", "peak_waiting"):
            doc.pop(key)
        return doc

    one = run(1)
    monkeypatch.setattr(shard_module, "FOLD_REQUESTS", 64)
    monkeypatch.setattr(shard_module, "FOLD_STEPS", 256)
    for shards in (2, 4):
        got = run(shards)
        _approx_equal("result", one, got)
        for name in ("ttft", "tpot", "e2e", "queue"):
            for p in ("p50", "p90", "p95", "p99"):
                assert got["latency_ms"][name][p] == one["latency_ms"][name][p]


def test_shards_partition_the_replicas() -> None:
    """Shard ``j`` of ``K`` owns a contiguous block; together they own every replica once;
    at most one shard per replica; only the first counts the refusals."""
    dep = _gpt_oss(10)
    jobs = shard_jobs(dep, _mix(), 7, 4)
    assert [job.replicas for job in jobs] == [(0, 1), (2, 3, 4), (5, 6), (7, 8, 9)]
    assert [job.counts_refusals for job in jobs] == [True, False, False, False]
    assert len({job.key for job in jobs}) == 4 and {job.seed for job in jobs} == {7}
    assert len(shard_jobs(dep, _mix(), 7, 64)) == 10


def test_a_shard_keeps_only_its_own_arrivals() -> None:
    """A shard's figures cover its replicas' requests only: the shards' completions add up
    to the run's, each worker's requests are counted by its own shard, and a job is a
    pure function of its inputs (run twice, the same figures)."""
    dep, wl, _ = SCENARIOS["poisson"]
    jobs = shard_jobs(dep, wl, wl.seed, 2)
    results = [run_shard(job) for job in jobs]
    assert sum(r.arrivals for r in results) == wl.num_requests
    assert all(r.stream_arrivals == wl.num_requests for r in results)
    for job, r in zip(jobs, results, strict=True):
        assert {w.worker for w in r.workers} == set(job.replicas)
        again = run_shard(job)
        assert (again.completed, again.steps, again.last_finish) == (
            r.completed,
            r.steps,
            r.last_finish,
        )
        assert again.kv_usage_sum == r.kv_usage_sum
        for name, sketch in r.latencies.items():
            for a, b in zip(again.latencies[name].buckets(), sketch.buckets(), strict=True):
                assert np.array_equal(a, b)


def _broken(job: ShardJob) -> ShardResult:
    if job.replicas[0] > 0:
        raise RuntimeError("worker lost")
    return run_shard(job)


def test_a_failed_shard_fails_the_run_with_its_reason() -> None:
    dep, wl, _ = SCENARIOS["poisson"]
    with pytest.raises(SimError, match=r"shard 2 of 2 \(2 replicas\) failed: .*worker lost"):
        run_fleet(dep, wl, InlineExecutor(_broken), shards=2)


def _refusal(dep: Deployment, wl: Workload | Trace) -> str:
    with pytest.raises(ConfigError) as info:
        run_fleet(dep, wl, InlineExecutor(run_shard), shards=2)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--ray: ")
    return message


@pytest.mark.parametrize(
    ("router", "reads"),
    [
        ("least_loaded", "every replica's load"),
        ("prefix_affinity", "every replica's load and prefix cache"),
        ("kv_aware", "every replica's prefix cache and queued prefill"),
    ],
)
def test_routers_that_read_the_replicas_are_refused(router: str, reads: str) -> None:
    dep = _gpt_oss(4)
    dep = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, router=router))
    assert f"router {router} cannot be sharded: it reads {reads}" in _refusal(dep, _mix())


def test_what_else_cannot_be_sharded_is_refused() -> None:
    dep = _gpt_oss(4)
    sessions = load_workload(WORKLOADS / "chat-sessions-200.toml")
    closed = load_workload(WORKLOADS / "chat-closed-64.toml")
    for router in ("round_robin", "random"):
        message = _refusal(_routed(dep, router), sessions)
        assert f"a session workload under {router} cannot be sharded" in message
    closed_sessions = attrs.evolve(
        sessions, arrival_pattern="closed_loop", num_concurrent_users=8, arrival_rate=None
    )
    message = _refusal(_routed(dep, "session_affinity"), closed_sessions)
    assert "closed-loop sessions cannot be sharded: each user's next session" in message
    for router in ("round_robin", "random", "session_affinity"):
        message = _refusal(_routed(dep, router), closed)
        assert "a closed-loop workload cannot be sharded: each request's lengths" in message
    bounded = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, max_waiting=10))
    assert "max_waiting bounds the waiting places of all replicas" in _refusal(bounded, _mix())
    speculating = shard_deployment(load_deployment(FRONTIER, "b200"), 2)
    assert speculating.speculative is not None
    assert "speculative decoding cannot be sharded" in _refusal(speculating, _mix())
    split = split_pd(dep, 1, 1)
    assert "a disaggregated deployment cannot be sharded" in _refusal(split, _mix())
    tiered = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, kv_offloading_size=8.0))
    assert "KV tiers are not sharded yet" in _refusal(tiered, _mix())


# ---------------------------------------------------------------------------------------
# the command's flags (the sharded run itself on Ray: tests/test_sim_fleet_ray.py)


def _sim(*argv: str) -> int:
    return cli.main(["sim", "--config", str(GPT_OSS_20B), "--hardware", "b200", *argv])


def test_replicas_overrides_the_entry(capsys: pytest.CaptureFixture[str]) -> None:
    """``--replicas N`` runs N replicas behind the entry's router, sharded or not."""
    assert _sim("--workload", str(WORKLOADS / "quick.toml"), "--replicas", "3") == 0
    out = capsys.readouterr().out
    assert "3 replicas (round_robin)" in out and "replicas     3: requests 17 / 17 / 16" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shards", "2"], "--shards applies to --ray only"),
        (["--ray", "--request-csv", "r.csv"], "--request-csv needs every request's record"),
        (["--ray", "--report", "r.html"], "--report needs every request's record"),
        (["--ray", "--timeseries", "s.csv"], "--timeseries needs every request's record"),
        (["--ray", "--shards", "0"], "argument --shards: must be an integer >= 1, got 0"),
        (["--replicas", "0"], "argument --replicas: must be an integer >= 1, got 0"),
        (["--replicas", "2", "--pd", "1P1D"], "--replicas does not go with --pd"),
    ],
)
def test_flags_that_do_not_go_with_ray_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line, exit 2, before any simulation or Ray."""
    rc = _sim("--workload", str(WORKLOADS / "quick.toml"), *argv)
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0]


def test_what_cannot_be_sharded_is_one_line_before_ray_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--ray`` with a closed loop: exit 1, the reason in one line, and Ray never
    imported (the check comes first)."""
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    rc = _sim("--workload", str(WORKLOADS / "chat-closed-64.toml"), "--ray", "-q")
    err = capsys.readouterr().err.splitlines()
    assert rc == 1 and len(err) == 1
    assert err[0].startswith("inference-lab sim: error: --ray: a closed-loop workload")
    assert "ray" not in sys.modules


def test_a_cluster_that_cannot_be_reached_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``ray.init`` raises for a bad address is a SimError naming the address, its
    first line only (the CLI's one-line error)."""
    from inference_lab.executors import ray_backend

    class Unreachable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ConnectionError("Could not find any running Ray instance.\nPlease specify ...")

    monkeypatch.setattr(ray_backend, "RayExecutor", Unreachable)
    dep, wl, _ = SCENARIOS["poisson"]
    with pytest.raises(SimError) as info:
        run_on_ray("auto", dep, wl)  # (no probe: Rule 5 of sim.fleet)
    assert str(info.value) == "--ray auto: Could not find any running Ray instance."


def test_an_address_where_nothing_listens_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--ray 127.0.0.1:PORT`` with no cluster there (a port just freed): a SimError naming
    the address, one line, within a bound (the run is in a thread abandoned past 30 s),
    before Ray is imported."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    dep, wl, _ = SCENARIOS["poisson"]
    monkeypatch.delitem(sys.modules, "ray", raising=False)

    def attempt() -> str:
        with pytest.raises(SimError) as info:
            run_on_ray(address, dep, wl)
        return str(info.value)

    async def bounded() -> str:
        with trio.fail_after(30):
            return await trio.to_thread.run_sync(attempt, abandon_on_cancel=True)

    message = trio.run(bounded)
    assert message == f"--ray {address}: no Ray cluster answers there (Connection refused)"
    assert "ray" not in sys.modules


def test_an_address_that_does_not_answer_in_time_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection that times out (a host that drops the packets) is the same one line,
    saying how long the probe waited; ``local``, ``auto`` and an address without a port
    are left to Ray."""

    def silent(address: tuple[str, int], timeout: float) -> socket.socket:
        assert address == ("10.1.2.3", 6379) and timeout == 0.25
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    with pytest.raises(SimError) as info:
        probe_address("ray://10.1.2.3:6379", timeout=0.25)
    assert str(info.value) == (
        "--ray ray://10.1.2.3:6379: no Ray cluster answers there (no connection within 0.25 s)"
    )
    for address in ("local", "auto", "headnode"):
        probe_address(address)  # (create_connection not called)


# ---------------------------------------------------------------------------------------
# traces


def _trace(path: Path, rng: np.random.Generator, count: int) -> Trace:
    """A Mooncake trace of ``count`` requests at ~300/s: integer milliseconds (ties),
    some lines out of order, prefix chains from eight groups (the replicas' caches hit),
    a few prompts past a 1,400-token context."""
    stamps = np.cumsum(rng.exponential(1000 / 300, count)).astype(np.int64)
    order = np.arange(count)
    for i in range(0, count - 3, 37):
        order[[i, i + 2]] = order[[i + 2, i]]
    lines = []
    for i in order.tolist():
        group = int(rng.integers(8))
        blocks = int(rng.integers(1, 6))
        prompt = int(rng.integers(1, 4)) * 512 if i % 50 else 1_500
        lines.append(
            json.dumps(
                {
                    "timestamp": int(stamps[i]),
                    "input_length": max(prompt, blocks * 512 - 100),
                    "output_length": int(rng.integers(1, 300)),
                    "hash_ids": [group * 100 + b for b in range(blocks)],
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return read_trace(path, format="mooncake")


@pytest.mark.parametrize(
    ("router", "shards"), [("round_robin", 3), ("random", 2), ("session_affinity", 4)]
)
def test_a_sharded_trace_is_the_unsharded_one(router: str, shards: int, tmp_path: Path) -> None:
    """A trace's arrivals are fixed times, so each state-blind router places them without
    reading a replica: sharded, every figure is the unsharded run's (prefix-cache hits
    per replica, refusals and the capacity verdict included)."""
    trace = _trace(tmp_path / "t.jsonl", np.random.default_rng(7), 700)
    gpt = _gpt_oss(4)
    dep = _routed(attrs.evolve(gpt, model=attrs.evolve(gpt.model, max_seq_len=1_400)), router, 2)
    result, want = _same_answer(dep, trace, shards)
    assert want["requests"]["refused"] > 0 and want["prefix_cache"]["hit_tokens"] > 0
    assert result.fleet is not None
    assert result.fleet.refusals == (("max_seq_len", want["requests"]["refused"]),)
    assert want["capacity"] is not None and result.seed == 0 and result.has_content


def test_a_sharded_trace_with_a_frontend_latency_and_dp_ranks(tmp_path: Path) -> None:
    """Data-parallel ranks in lockstep, a frontend latency, random draws: still the
    unsharded run."""
    trace = _trace(tmp_path / "t.jsonl", np.random.default_rng(3), 500)
    dp = load_deployment(FRONTIER, "b200")
    dp = attrs.evolve(
        shard_deployment(dp, 3),
        speculative=None,
        acceptance_rates=(),
        scheduler=attrs.evolve(dp.scheduler, frontend_latency=0.002),
    )
    _same_answer(_routed(dp, "random", 1), trace, 2)


def test_the_vector_draws_are_the_routers() -> None:
    """``sharding.draws`` (arrays) gives ``router.draw`` (the engine's) for every key and
    seed, including seeds past 64 bits, as ``route`` maps them to workers."""
    keys = np.array([0, 1, 2, 5, 1_000_003, 2**40 + 7, 2**62], np.int64)
    for seed in (0, 1, 1234567, 2**64 + 5, 2**70):
        got = draws(seed, keys).tolist()
        assert got == [draw(seed, int(k)) for k in keys.tolist()]
    dep = _routed(_gpt_oss(5), "random", 9)
    assert route(dep, keys).tolist() == [draw(9, int(k)) % 5 for k in keys.tolist()]
    assert route(_gpt_oss(5), keys).tolist() == [int(k) % 5 for k in keys.tolist()]


# ---------------------------------------------------------------------------------------
# sessions under session_affinity


def _sessions(sessions: int, turns_cap: int | None) -> Workload:
    """chat-sessions-200's sessions (8 turns, a shared 2,048-token system prompt, think
    times of 5 s), ``sessions`` of them starting at 6 a second."""
    wl = load_workload(WORKLOADS / "chat-sessions-200.toml")
    assert wl.sessions is not None
    return attrs.evolve(
        wl,
        arrival_rate=6.0,
        num_requests=turns_cap,
        sessions=attrs.evolve(wl.sessions, num_sessions=sessions),
    )


@pytest.mark.parametrize(
    ("context", "shards"), [(None, 2), (4_000, 3)], ids=["all turns", "late turns refused"]
)
def test_sharded_sessions_are_the_unsharded_run(context: int | None, shards: int) -> None:
    """Sessions routed by session_affinity: every turn follows its own session's answer
    on its own replica, so sharded, every figure is the unsharded run's -- the session
    table per turn (TTFT percentiles within the sketch's bound), prefix hits per replica,
    the refusals of turns past the context (summed over the shards) -- but the capacity
    verdict, which a sharded session run does not give."""
    dep = _routed(_gpt_oss(5), "session_affinity", 5)  # (5: no power of two nests)
    if context is not None:
        dep = attrs.evolve(dep, model=attrs.evolve(dep.model, max_seq_len=context))
    wl = _sessions(60, 480)
    want = run_simulation(dep, wl).to_dict()
    result = _inline(dep, wl, shards)
    got = result.to_dict()
    assert result.fleet is not None and result.capacity is None
    got.pop("fleet"), got.pop("capacity")
    assert want.pop("capacity") is not None
    for key in ("wall_s", "speedup"):
        want["time"].pop(key), got["time"].pop(key)
    assert got.pop("peak_waiting") >= want.pop("peak_waiting")
    _approx_equal("result", want, got)
    assert want["sessions"]["sessions"] == 60 and want["prefix_cache"]["hit_tokens"] > 0
    assert result.has_content is run_simulation(dep, _sessions(2, None)).has_content is True
    assert len({r["requests"] for r in want["replicas"]}) > 1
    if context is None:
        assert want["requests"]["refused"] == 0 and want["sessions"]["turns"] == 480
    else:
        refused = want["requests"]["refused"]
        assert refused > 0 and want["sessions"]["turns"] + refused < 480  # (sessions ended)
        assert result.fleet.refusals == (("max_seq_len", refused),)


def test_a_turn_cap_that_binds_is_refused_before_any_shard_runs(tmp_path: Path) -> None:
    """num_requests below the turns the sessions plan caps them in the deployment's order
    of turns, which no shard sees (shard_sessions Rule 2): the driver refuses it in one
    line before a shard is sent (``run_fleet`` submits nothing; ``run_on_ray`` refuses
    before it probes the address or starts Ray), and a shard given one all the same
    refuses it too. A cap the sessions fit passes."""
    dep = _routed(_gpt_oss(2), "session_affinity")
    submitted: list[ShardJob] = []

    class Recording(InlineExecutor[ShardJob, ShardResult]):
        def submit(self, job: ShardJob) -> None:
            submitted.append(job)
            super().submit(job)

    with pytest.raises(ConfigError) as info:
        run_fleet(dep, _sessions(10, 79), Recording(run_shard), shards=2)
    message = str(info.value)
    assert "\n" not in message and submitted == []
    assert message.startswith("--ray: num_requests (79) caps the turns of all sessions together")
    assert "the sessions plan 80" in message
    with pytest.raises(ConfigError, match="caps the turns"):  # before the address's probe
        run_on_ray("127.0.0.1:1", dep, _sessions(10, 79))
    (job,) = shard_jobs(dep, _sessions(10, 79), 0, 1)
    with pytest.raises(ConfigError, match="the sessions plan 80"):
        run_shard(job)
    assert run_fleet(dep, _sessions(10, 80), Recording(run_shard), shards=2).fleet is not None
