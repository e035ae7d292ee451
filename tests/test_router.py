"""The state-blind routers ``random`` and ``session_affinity`` (core/engine/router.py,
Rule 3): hand-checked draws, each arrival's worker as the draw says whatever the workers'
load, a session's every turn on one worker, the seed and the config key."""

from __future__ import annotations

from pathlib import Path

import attrs

from inference_lab.core.config import load_workload
from inference_lab.core.engine import Engine
from inference_lab.core.engine.router import draw
from inference_lab.sim.run import run_simulation
from inference_lab.sim.shard import shard_deployment
from tests.configs_util import WORKLOADS
from tests.engine_util import deployment, finished, run, spec
from tests.test_config import dense_config, load, load_error


def test_draw_is_splitmix64() -> None:
    """SplitMix64's published outputs: seeded with 1234567, its first three (Vigna's
    reference test); seeded with 0, its first is 0xE220A8397B1DCDAF."""
    assert [draw(1234567, k) for k in range(3)] == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
    ]
    assert draw(0, 0) == 0xE220A8397B1DCDAF


def _placed(dep_router: str, seed: int, specs: list[dict[str, int]], loaded: bool) -> list[int]:
    """The workers of ``specs`` (submitted in order, each at t = 0) on 3 replicas;
    ``loaded`` first fills worker 0 with long requests (which a state-reading router would
    avoid)."""
    dep = deployment(replicas=3, router=dep_router)
    dep = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, router_seed=seed))
    eng = Engine(dep)
    if loaded:
        for _ in range(5):
            eng.submit(spec(4_000, 500, worker=0))
    ids = [eng.submit(spec(10, 5, **kw)) for kw in specs]
    where = finished(run(eng))
    return [where[i].worker for i in ids]


def test_random_places_the_kth_arrival_by_the_kth_draw() -> None:
    """Seed 0, 3 workers: draw(0, k) mod 3 for k = 0..7 is 1 0 1 1 1 0 2 2 (computed
    from the reference generator above); seed 7 gives 0 0 0 0 1 0 1 0. Requests routed by
    the caller (``worker=``) take no draw; a loaded worker 0 changes nothing."""
    eight: list[dict[str, int]] = [{}] * 8
    assert _placed("random", 0, eight, loaded=False) == [1, 0, 1, 1, 1, 0, 2, 2]
    assert _placed("random", 0, eight, loaded=True) == [1, 0, 1, 1, 1, 0, 2, 2]
    assert _placed("random", 7, eight, loaded=False) == [0, 0, 0, 0, 1, 0, 1, 0]


def test_session_affinity_keeps_a_session_on_one_worker() -> None:
    """Seed 0, 3 workers: session s to draw(0, s) mod 3 (sessions 2, 5, 9, 11 to 1, 0, 2,
    1), every time, whatever the load; a request without a session is placed as random
    places the k-th arrival (k counts every arrival the router placed: here k = 5 -> 0,
    k = 6 -> 2)."""
    sessions = [{"session": s} for s in (5, 9, 5, 2, 11)] + [{}, {}]
    want = [0, 2, 0, 1, 1, 0, 2]
    assert _placed("session_affinity", 0, sessions, loaded=False) == want
    assert _placed("session_affinity", 0, sessions, loaded=True) == want


def test_a_session_workload_runs_each_session_on_one_replica() -> None:
    """``sim`` with session_affinity: the intake gives each turn its session, so every turn
    of a session finishes on the replica its session draws, and the sessions spread over
    all four."""
    wl = attrs.evolve(load_workload(WORKLOADS / "chat-sessions-200.toml"), num_requests=400)
    wl = attrs.evolve(wl, sessions=attrs.evolve(wl.sessions, num_sessions=50))
    dep = shard_deployment(deployment(router="session_affinity"), 4)
    result = run_simulation(dep, wl)
    assert result.summary.requests_completed == 400
    replicas: dict[int, set[int]] = {}
    for f in result.finished:
        replicas.setdefault(result.arrivals[f.request_id].session, set()).add(f.worker)
    assert len(replicas) == 50
    assert all(w == {draw(0, s) % 4} for s, w in replicas.items())
    assert {w for ws in replicas.values() for w in ws} == {0, 1, 2, 3}


def test_the_routers_and_their_seed_are_config_keys(tmp_path: Path) -> None:
    """``router = "random"`` / ``"session_affinity"`` (case-insensitive) with
    ``router_seed`` (default 0); a negative seed is a load error naming the key."""
    (tmp_path / "a").mkdir()
    cfg = load(tmp_path / "a", dense_config(hardware={"gpu": {"router": "Random"}}))
    hw = cfg.deployments["gpu"].hardware
    assert (hw.router, hw.router_seed) == ("random", 0)
    (tmp_path / "b").mkdir()
    cfg = load(
        tmp_path / "b",
        dense_config(hardware={"gpu": {"router": "session_affinity", "router_seed": 9}}),
    )
    hw = cfg.deployments["gpu"].hardware
    assert (hw.router, hw.router_seed) == ("session_affinity", 9)
    (tmp_path / "c").mkdir()
    _, message = load_error(tmp_path / "c", dense_config(hardware={"gpu": {"router_seed": -1}}))
    assert "hardware.gpu.router_seed" in message


def test_the_default_stays_round_robin() -> None:
    """The default router is round_robin (arrival k to worker k mod 3)."""
    assert deployment().hardware.router == "round_robin"
    assert _placed("round_robin", 0, [{}] * 6, loaded=False) == [0, 1, 2, 0, 1, 2]
