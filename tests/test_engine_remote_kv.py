"""The engine pieces a prefill server and a decode server use (``serve --role``, without
``[disaggregation]``): a request that holds its KV for a remote decode until
``Engine.release_kv``, and a request whose KV a remote prefill computed
(``remote_positions``), received over the profile's scale-out link and announced by
``Engine.take_kv_arrived``.

Llama-3.1-8B on H100 (tp 1, block size 16): 131,072 bytes of KV per position; the
profile's NIC (scale_out) is 50 GB/s and 20 us.
"""

from __future__ import annotations

from inference_lab.core.engine import Engine, RequestSpec, RequestStatus
from inference_lab.core.engine.handoff import remote_positions
from tests.engine_util import LLAMA8B, deployment, finished, run

BYTES_PER_POSITION = 131_072
NIC = (50e9, 2e-5)


def test_a_held_request_keeps_its_blocks_until_released() -> None:
    """``hold_kv``: the request finishes (its one token reported) but its 63 blocks (1,000
    positions, block size 16) stay held, its status HELD, until ``release_kv``; a second
    release finds nothing."""
    eng = Engine(deployment(LLAMA8B, "h100"))
    rid = eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=1, hold_kv=True))
    events = run(eng)
    (f,) = finished(events).values()
    assert (f.request_id, f.output_tokens) == (rid, 1)
    stats = eng.statistics()
    assert (stats.kv_used_blocks, stats.workers[0].held) == (63, 1)
    assert eng.workers[0].held[rid].status == RequestStatus.HELD
    assert eng.abort(rid) is False  # finished: an abort cannot free it
    assert eng.release_kv(rid) is True
    stats = eng.statistics()
    assert (stats.kv_used_blocks, stats.workers[0].held) == (0, 0)
    assert eng.release_kv(rid) is False


def test_a_release_wakes_a_worker_waiting_for_the_held_blocks() -> None:
    """With 70 blocks, a held 1,000-token request (63 blocks) leaves too few for a second
    one: it waits with nothing scheduled until the release, whose time its first step
    starts at."""
    eng = Engine(deployment(LLAMA8B, "h100", blocks=70))
    first = eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=1, hold_kv=True))
    second = eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=2))
    done = finished(run(eng))
    assert set(done) == {first}
    assert eng.num_waiting() == 1 and eng.next_event_time() is None
    eng.advance_to(5.0)
    assert eng.release_kv(first)
    assert eng.next_event_time() == 5.0
    done = finished(run(eng))
    assert done[second].first_scheduled_time == 5.0


def test_a_remote_prefill_is_received_over_the_nic_then_computed() -> None:
    """A 1,000-token prompt with ``remote_positions`` 992 (62 full blocks): its blocks are
    taken at once, the transfer costs 992 x 131,072 B / 50 GB/s + 20 us on the profile's
    NIC (tp 1: one link), and only then is the rest of the prompt (8 positions) computed,
    emitting the first token at the end of that step. ``take_kv_arrived`` names it once."""
    dep = deployment(LLAMA8B, "h100")
    k = remote_positions(1000, dep.scheduler.block_size)
    assert k == 992
    eng = Engine(dep)
    rid = eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=3, remote_positions=k))
    eng.step()  # the arrival
    eng.step()  # the worker's boundary at the same time: its blocks taken, the transfer on
    assert eng.now == 0.0
    stats = eng.statistics()
    assert (stats.workers[0].receiving, stats.transfers) == (1, 1)
    assert stats.kv_used_blocks == 62
    assert eng.take_kv_arrived() == ()
    bandwidth, latency = NIC
    sent = 992 * BYTES_PER_POSITION
    assert stats.transfer_bytes == sent
    assert eng.next_event_time() == latency + sent / bandwidth
    eng.step()  # the transfer's end
    assert eng.take_kv_arrived() == (rid,)
    assert eng.take_kv_arrived() == ()
    events = run(eng)
    f = finished(events)[rid]
    first_step = next(ev.step for ev in events if ev.step is not None)
    assert first_step.num_tokens == 8  # the partial block and the last position
    assert f.first_token_time == first_step.start + first_step.duration
    assert f.output_tokens == 3 and eng.statistics().kv_used_blocks == 0


def test_an_abort_while_receiving_frees_its_blocks_and_announces_nothing() -> None:
    """An abort during the transfer frees the received blocks; the transfer's end goes
    stale, so the request is never announced as arrived."""
    eng = Engine(deployment(LLAMA8B, "h100"))
    rid = eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=3, remote_positions=992))
    eng.step()
    eng.step()
    assert eng.statistics().workers[0].receiving == 1
    assert eng.abort(rid)
    run(eng)
    assert eng.take_kv_arrived() == ()
    assert eng.statistics().kv_used_blocks == 0


def test_a_disaggregated_engine_announces_no_arrivals() -> None:
    """With ``[disaggregation]`` the engine's own hand-offs release the prefill's blocks:
    nothing is left for a caller to take."""
    from inference_lab.core.config import split_pd

    eng = Engine(split_pd(deployment(LLAMA8B, "h100"), 1, 1))
    eng.submit(RequestSpec(prompt_tokens=1000, max_tokens=3))
    run(eng)
    assert eng.statistics().transfers == 1
    assert eng.take_kv_arrived() == ()
