"""Prefill/decode disaggregation in the engine (``core/engine/handoff.py``, scheduler Rule
6): hand-offs between the pools, transfers priced by hand, held blocks, back-pressure,
the decode side's own prefix cache, aborts, and the ``[disaggregation]`` table's errors.

Llama-3.1-8B: 32 attention layers of 8 KV heads x 128 dims in bf16, K and V: 2 x 8 x 128
x 2 = 4,096 bytes per position per layer, 131,072 bytes per position. The H100 profile's
NVLink: 450 GB/s and 5 us; its NIC: 50 GB/s and 20 us.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from inference_lab.core.config import Deployment, load_deployment, split_pd
from inference_lab.core.engine import Engine, Finished, RequestSpec, RequestStatus, StepEvents
from inference_lab.errors import ConfigError
from tests.engine_util import LLAMA8B, ROOT, deployment

BYTES_PER_POSITION = 131_072
NVLINK = (450e9, 5e-6)
NIC = (50e9, 2e-5)


def _pd(prefill: int = 1, decode: int = 1, **scheduler: object) -> Deployment:
    return split_pd(deployment(LLAMA8B, "h100", **scheduler), prefill, decode)


def _run(eng: Engine) -> tuple[list[StepEvents], list[Finished]]:
    events = []
    while eng.next_event_time() is not None:
        events.append(eng.step())
    return events, [f for ev in events for f in ev.finished]


def test_a_transfer_costs_its_bytes_over_the_link_plus_its_latency() -> None:
    """A lone 1,000-token prompt (block size 16) sends its 62 full blocks' 992 positions
    over NVLink (one prefill and one decode replica of tp 1 fit a node): 992 x 131,072 B
    / 450 GB/s + 5 us after its prefill ends, the decode replica has its KV."""
    dep = _pd()
    assert dep.disaggregation is not None and dep.disaggregation.link_name == "scale_up"
    eng = Engine(dep)
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=20))
    _, (f,) = _run(eng)
    sent = 992 * BYTES_PER_POSITION
    assert f.transfer_bytes == sent
    bandwidth, latency = NVLINK
    assert f.transfer_end_time == f.prefill_end_time + (latency + sent / bandwidth)
    assert f.prefill_worker == 0 and f.worker == 1
    assert f.first_scheduled_time == 0.0 and f.prefill_end_time > 0
    assert f.first_token_time > f.transfer_end_time and f.output_tokens == 20
    stats = eng.statistics()
    assert (stats.transfers, stats.transfer_bytes) == (1, float(sent))
    assert stats.kv_used_blocks == 0  # the held prefill blocks went back


def test_pools_beyond_a_node_send_over_the_nics_on_every_rank() -> None:
    """Two replicas of tp 8 on each side span 32 GPUs: the NICs, 8 links at once."""
    base = deployment(LLAMA8B, "h100")
    wide = attrs.evolve(base, hardware=attrs.evolve(base.hardware, tp=8))
    dep = split_pd(wide, 2, 2)
    split = dep.disaggregation
    assert split is not None and (split.link_name, split.streams) == ("scale_out", 8)
    bandwidth, latency = NIC
    assert split.transfer_seconds(1e9) == latency + 1e9 / (bandwidth * 8)


def test_an_overlapped_transfer_shows_what_the_prefill_did_not_hide() -> None:
    """With ``overlap`` the transfer is pushed layer by layer behind the prefill's last
    step: latency + max(wire / layers, wire - step)."""
    dep = _pd()
    split = dep.disaggregation
    assert split is not None
    split = attrs.evolve(split, overlap=True)
    wire = 1e9 / NVLINK[0]
    assert split.transfer_seconds(1e9, 0.001) == NVLINK[1] + (wire - 0.001)
    assert split.transfer_seconds(1e9, 1.0) == NVLINK[1] + wire / 32
    eng = Engine(attrs.evolve(dep, disaggregation=split))
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=5))
    _, (f,) = _run(eng)
    assert f.transfer_end_time - f.prefill_end_time < 992 * BYTES_PER_POSITION / NVLINK[0]


def test_the_prefill_pools_tokens_are_not_the_clients() -> None:
    """Every token a client sees comes from the decode pool: per request, the tokens
    reported add up to its output, the first at its first-token time."""
    eng = Engine(_pd(2, 1))
    for i in range(20):
        eng.submit(RequestSpec(prompt_tokens=300 + 37 * i, max_tokens=8, arrival_time=0.01 * i))
    events, finished = _run(eng)
    counts: dict[int, int] = {}
    first: dict[int, float] = {}
    for ev in events:
        for rid, n in ev.tokens:
            counts[rid] = counts.get(rid, 0) + n
            first.setdefault(rid, ev.time)
    assert len(finished) == 20
    for f in finished:
        assert counts[f.request_id] == f.output_tokens == 8
        assert first[f.request_id] == f.first_token_time
        assert f.worker == 2 and f.prefill_worker in (0, 1)


def test_a_full_decode_pool_keeps_the_prefills_blocks_held() -> None:
    """Back-pressure: a decode replica whose cache holds one request's KV at a time
    receives the second only after the first finishes; meanwhile the second's prefill
    blocks stay held on the prefill replica."""
    base = deployment(LLAMA8B, "h100", kv_cache_capacity=80 * 16 * BYTES_PER_POSITION)
    dep = split_pd(base, 1, 1)
    eng = Engine(dep)
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=200))
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=200, arrival_time=0.001))
    held_seen = False
    finished: list[Finished] = []
    while eng.next_event_time() is not None:
        ev = eng.step()
        finished += ev.finished
        stats = eng.statistics()
        if stats.workers[0].held and stats.workers[1].running and not finished:
            held_seen = True
    first, second = sorted(finished, key=lambda f: f.request_id)
    assert held_seen
    assert second.transfer_end_time > first.finish_time
    assert eng.statistics().kv_used_blocks == 0


def test_the_decode_sides_cached_prefix_is_not_sent() -> None:
    """A second turn resending the first's prompt: the decode replica caches the blocks
    it received, so only the new blocks cross the link."""
    eng = Engine(_pd())
    chain = tuple(range(1, 101))  # 100 blocks of 16
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=4, block_hashes=chain[:62]))
    eng.submit(RequestSpec(prompt_tokens=1600, max_tokens=4, arrival_time=1.0, block_hashes=chain))
    _, finished = _run(eng)
    first, second = sorted(finished, key=lambda f: f.request_id)
    assert first.transfer_bytes == 992 * BYTES_PER_POSITION
    assert second.transfer_bytes == (1584 - 992) * BYTES_PER_POSITION
    assert second.cached_tokens == 992  # the prefill side's own hit


@pytest.mark.parametrize("when", ["prefill", "held", "receiving", "decode"])
def test_an_abort_frees_both_sides_wherever_it_is(when: str) -> None:
    """Aborted in its prefill, with its prefill held while the decode side waits for
    blocks, while its KV is in flight, or decoding: every block comes back, nothing is
    reported for it, and the engine has no event left."""
    small = {"kv_cache_capacity": 80 * 16 * BYTES_PER_POSITION} if when == "held" else {}
    eng = Engine(_pd(**small))
    blocker = eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=200))
    rid = eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=50, arrival_time=0.002))
    finished: list[Finished] = []
    aborted = False
    while eng.next_event_time() is not None:
        ev = eng.step()
        finished += ev.finished
        r = eng._requests.get(rid)  # (which side it is on: the engine's own record)
        state = (
            r is not None
            and {
                "prefill": r.status == RequestStatus.RUNNING and r.hold_kv,
                "held": rid in eng.workers[0].held,
                "receiving": r.status == RequestStatus.RECEIVING,
                "decode": r.status == RequestStatus.RUNNING and not r.hold_kv,
            }[when]
        )
        if state and not aborted:
            assert eng.abort(rid)
            aborted = True
    assert aborted
    assert [f.request_id for f in finished] == [blocker]
    stats = eng.statistics()
    assert stats.kv_used_blocks == 0 and stats.running == 0 and stats.waiting == 0


def _config(tmp_path: Path, table: str) -> Path:
    text = (ROOT / "configs" / "Llama-3.1-8B-Instruct.toml").read_text()
    path = tmp_path / "pd.toml"
    path.write_text(text + "\n" + table)
    return path


def test_a_disaggregation_table_splits_the_selected_entry(tmp_path: Path) -> None:
    """``[disaggregation]``: the pools' replicas, routers and scheduler keys."""
    path = _config(
        tmp_path,
        "[disaggregation]\noverlap = true\nhandoff_latency = 0.001\n"
        "[disaggregation.prefill]\nreplicas = 2\nrouter = 'prefix_affinity'\n"
        "scheduler = { max_num_batched_tokens = 16384 }\n"
        "[disaggregation.decode]\nreplicas = 3\nrouter = 'kv_free'\n",
    )
    dep = load_deployment(path, "h100", profiles_dir=ROOT / "hardware_profiles")
    split = dep.disaggregation
    assert split is not None
    assert (split.prefill.hardware.replicas, split.decode.hardware.replicas) == (2, 3)
    assert (split.prefill_router, split.decode_router) == ("prefix_affinity", "kv_free")
    assert split.prefill.scheduler.max_num_batched_tokens == 16384
    assert (split.overlap, split.handoff_latency) == (True, 0.001)


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ("[disaggregation.prefill]\nhardware = 'nope'\n", "disaggregation.prefill.hardware: no"),
        ("[disaggregation.decode]\nrouter = 'prefix_affinity'\n", "disaggregation.decode.router"),
        ("[disaggregation.decode]\nreplicas = 0\n", "disaggregation.decode.replicas"),
        ("[disaggregation]\nlink = 'carrier-pigeon'\n", "disaggregation.link"),
        ("[disaggregation]\nhandoff_latency = nan\n", "disaggregation.handoff_latency"),
        ("[disaggregation.decode]\nscheduler = { block_size = 32 }\n", "block_size differ"),
        ("[disaggregation.decode]\nscheduler = { max_num_seqs = 0 }\n", "max_num_seqs"),
    ],
)
def test_a_bad_disaggregation_table_is_one_line_naming_the_key(
    tmp_path: Path, table: str, fragment: str
) -> None:
    path = _config(tmp_path, table)
    with pytest.raises(ConfigError) as err:
        load_deployment(path, "h100", profiles_dir=ROOT / "hardware_profiles")
    message = str(err.value)
    assert "\n" not in message and fragment in message and str(path) in message


def test_a_request_that_cannot_fit_either_pool_is_refused() -> None:
    """``check_fits``: the whole request on the decode pool, its prompt on the prefill
    pool (a small prefill pool refuses a long prompt)."""
    base = deployment(LLAMA8B, "h100")
    split = split_pd(base, 1, 1).disaggregation
    assert split is not None
    small = attrs.evolve(
        split.prefill,
        scheduler=attrs.evolve(split.prefill.scheduler, kv_cache_capacity=50 * 16 * 131_072),
    )
    eng = Engine(attrs.evolve(base, disaggregation=attrs.evolve(split, prefill=small)))
    refused = eng.check_fits(2000, 10)
    assert refused is not None and refused.limit == "kv_cache"
    assert eng.check_fits(500, 3000) is None
