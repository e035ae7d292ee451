"""KV tiers behind HBM (``core/engine/kv_tiers.py``): blocks HBM evicts go to host memory
and on to a disk, and a returning prefix is fetched from them -- or recomputed when that
is cheaper -- priced by hand here.

Llama-3.1-8B on H100: a block is 16 positions x 131,072 B = 2 MiB; the profile's host link
is PCIe Gen5, 64 GB/s and 10 us per GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_lab.core.config import Deployment, load_deployment
from inference_lab.core.engine import Engine, Finished, RequestSpec
from inference_lab.core.engine.block_pool import BlockRemoved, BlockStored
from inference_lab.errors import ConfigError
from tests.engine_util import LLAMA8B, ROOT, assert_blocks_conserved, deployment

BLOCK = 16 * 131_072
PCIE = (64e9, 1e-5)


def _dep(blocks: int = 100, **keys: object) -> Deployment:
    return deployment(LLAMA8B, "h100", blocks=blocks, **keys)


def _chain(start: int, count: int) -> tuple[int, ...]:
    return tuple(range(start, start + count))


def _run(eng: Engine) -> list[Finished]:
    out: list[Finished] = []
    while eng.next_event_time() is not None:
        out += eng.step().finished
        assert_blocks_conserved(eng)
    return out


def test_evicted_blocks_go_to_the_host_then_the_disk_least_recently_used_first() -> None:
    """Rule 1: HBM's evictions fill the host tier; a full host tier passes its oldest to
    the disk; events say where (``medium``)."""
    dep = _dep(blocks=100, kv_offloading_size=60 * BLOCK / 2**30, kv_offloading_disk_size=1.0)
    eng = Engine(dep, record_kv_events=True)
    for i in range(4):  # four prompts of 80 blocks each, one after the other
        eng.submit(
            RequestSpec(
                prompt_tokens=1281,
                max_tokens=1,
                arrival_time=float(i),
                block_hashes=_chain(1000 * i, 80),
            )
        )
    _run(eng)
    stats = eng.statistics().tiers
    assert stats is not None and stats.host_capacity == 60
    assert stats.host_blocks == 60 and stats.disk_blocks > 0
    events = eng.take_kv_events()
    mediums = {(type(e).__name__, e.medium) for e in events if not isinstance(e, tuple)}
    assert ("BlockStored", "CPU") in mediums and ("BlockRemoved", "CPU") in mediums
    assert ("BlockStored", "DISK") in mediums
    first_cpu = next(e for e in events if isinstance(e, BlockStored) and e.medium == "CPU")
    gpu_removed = next(e for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU")
    assert first_cpu.block_hashes == gpu_removed.block_hashes  # what HBM evicted


def test_a_returning_prefix_is_fetched_at_the_host_links_price() -> None:
    """Rule 3: a third request resending the first's 62-block prefix, most of which HBM
    evicted to the host tier for the second (tail first), finds the rest in HBM and the
    evicted blocks in the host tier, and waits 10 us + blocks x 2 MiB / 64 GB/s for them
    instead of computing them."""
    dep = _dep(blocks=70, kv_offloading_size=1.0)
    eng = Engine(dep)
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=1, block_hashes=_chain(1, 62)))
    eng.submit(
        RequestSpec(
            prompt_tokens=1000, max_tokens=1, arrival_time=1.0, block_hashes=_chain(500, 62)
        )
    )  # pushes the first out of HBM
    eng.submit(
        RequestSpec(prompt_tokens=1000, max_tokens=1, arrival_time=2.0, block_hashes=_chain(1, 62))
    )
    finished = {f.request_id: f for f in _run(eng)}
    stats = eng.statistics().tiers
    assert stats is not None
    third = finished[3]
    # the whole prefix found, part in HBM and part in the host tier; like vLLM, the
    # tokens a connector supplied count as cached
    assert stats.fetches == 1 and 0 < stats.host_hit_tokens < 62 * 16
    assert third.cached_tokens == 62 * 16
    fetched = stats.host_hit_tokens // 16 * BLOCK
    assert stats.fetch_bytes == fetched
    assert stats.fetch_seconds == PCIE[1] + fetched / PCIE[0]
    assert third.first_scheduled_time == 2.0
    assert third.first_token_time - third.arrival_time < (
        finished[1].first_token_time - finished[1].arrival_time
    )


def test_each_request_in_the_queue_plans_its_own_fetch() -> None:
    """Rule 3 for every admission: two conversations return together, both pushed out of
    HBM into the host tier; the one behind the first fetch is planned when it reaches the
    head too, and fetches its own prefix rather than computing it."""
    dep = _dep(blocks=70, kv_offloading_size=1.0)
    eng = Engine(dep)
    for i, start in enumerate((1, 100, 500)):  # the third pushes the first two out
        count = 62 if start == 500 else 30
        eng.submit(
            RequestSpec(
                prompt_tokens=count * 16 + 1,
                max_tokens=1,
                arrival_time=float(i),
                block_hashes=_chain(start, count),
            )
        )
    for start in (1, 100):
        eng.submit(
            RequestSpec(
                prompt_tokens=30 * 16 + 1,
                max_tokens=1,
                arrival_time=3.0,
                block_hashes=_chain(start, 30),
            )
        )
    finished = {f.request_id: f for f in _run(eng)}
    stats = eng.statistics().tiers
    assert stats is not None and stats.fetches == 2
    assert finished[4].cached_tokens == finished[5].cached_tokens == 30 * 16
    assert stats.host_hit_tokens == 2 * 30 * 16


def test_a_disk_fetch_crosses_the_disk_and_then_the_host_link() -> None:
    """Rule 3's disk price: latency + bytes / bandwidth on the disk, then over PCIe."""
    dep = _dep(
        blocks=70,
        kv_offloading_size=10 * BLOCK / 2**30,
        kv_offloading_disk_size=1.0,
        kv_offloading_disk_bandwidth=50e9,
        kv_offloading_disk_latency=2e-4,
    )
    eng = Engine(dep)
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=1, block_hashes=_chain(1, 62)))
    eng.submit(
        RequestSpec(
            prompt_tokens=1000, max_tokens=1, arrival_time=1.0, block_hashes=_chain(500, 62)
        )
    )
    eng.submit(
        RequestSpec(prompt_tokens=1000, max_tokens=1, arrival_time=2.0, block_hashes=_chain(1, 62))
    )
    _run(eng)
    stats = eng.statistics().tiers
    assert stats is not None and stats.fetches == 1
    tier = eng.workers[0].tiers
    assert tier is not None
    host, disk = stats.host_hit_tokens // 16, stats.disk_hit_tokens // 16
    assert disk > 0
    expected = 0.0
    if host:
        expected += PCIE[1] + host * BLOCK / PCIE[0]
    expected += 2e-4 + disk * BLOCK / 50e9
    expected += PCIE[1] + disk * BLOCK / PCIE[0]
    assert stats.fetch_seconds == expected == tier.fetch_seconds(host, disk)


def test_a_prefix_cheaper_to_compute_is_recomputed() -> None:
    """Rule 3: a disk that slow costs more than the prefill: the blocks are computed, and
    counted as recomputed."""
    dep = _dep(
        blocks=70,
        kv_offloading_size=10 * BLOCK / 2**30,
        kv_offloading_disk_size=1.0,
        kv_offloading_disk_bandwidth=1e6,
    )
    eng = Engine(dep)
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=1, block_hashes=_chain(1, 62)))
    eng.submit(
        RequestSpec(
            prompt_tokens=1000, max_tokens=1, arrival_time=1.0, block_hashes=_chain(500, 62)
        )
    )
    eng.submit(
        RequestSpec(prompt_tokens=1000, max_tokens=1, arrival_time=2.0, block_hashes=_chain(1, 62))
    )
    _run(eng)
    stats = eng.statistics().tiers
    assert stats is not None
    assert stats.fetches == 0 and stats.recomputed_tokens == 55 * 16  # (7 blocks hit in HBM)


def _config(tmp_path: Path, scheduler: str, profile_extra: str = "") -> Path:
    text = (ROOT / "configs" / "Llama-3.1-8B-Instruct.toml").read_text()
    text = text.replace("[scheduler]\n", "[scheduler]\n" + scheduler, 1)
    path = tmp_path / "m.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("keys", "fragment"),
    [
        ("kv_offloading_size = 300\n", "more than the host memory of the replica's 1 GPU(s)"),
        ("kv_offloading_size = -1\n", "scheduler.kv_offloading_size"),
        ("kv_offloading_size = nan\n", "scheduler.kv_offloading_size"),
        (
            "kv_offloading_size = 10\nkv_offloading_disk_size = 10\n"
            "kv_offloading_disk_bandwidth = 0\n",
            "kv_offloading_disk_bandwidth",
        ),
        ("kv_offloading_disk_size = 10\n", "sits behind a host tier"),
    ],
)
def test_a_bad_tier_is_one_line_naming_the_key(tmp_path: Path, keys: str, fragment: str) -> None:
    path = _config(tmp_path, keys)
    with pytest.raises(ConfigError) as err:
        load_deployment(path, "h100", profiles_dir=ROOT / "hardware_profiles")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_host_tier_needs_the_profiles_host_link(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for path in (ROOT / "hardware_profiles").glob("*.toml"):
        text = path.read_text()
        (profiles / path.name).write_text(
            text[: text.index("[host]")] if "[host]" in text else text
        )
    path = _config(tmp_path, "kv_offloading_size = 10\n")
    with pytest.raises(ConfigError) as err:
        load_deployment(path, "h100", profiles_dir=profiles)
    assert "has no [host] table" in str(err.value)
