"""What the KV-event sockets cost at worst (:mod:`inference_lab.serve.kv_events`,
:mod:`inference_lab.serve.kv_replay`): a replay flood is served at a bounded rate and
never holds live batches back, a requester that does not read loses its answer instead
of growing the server, a subscriber that never reads is held to the PUB socket's
high-water mark, remembered token streams are forgotten once stored, and endpoints bound
beyond loopback are warned about at start-up.

Counts, not timings: the replay's token bucket runs on a clock the test moves, and the
sockets that must fill are ``inproc://`` ones, whose queues hold exactly their high-water
marks.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import zmq

from inference_lab.core.engine import BlockRemoved, BlockStored
from inference_lab.serve.kv_events import (
    END_SEQ,
    KVEventsSettings,
    ModelPublisher,
    ReplayLimits,
    exposure_warnings,
)
from inference_lab.serve.kv_replay import ReplayBuffer, ReplayService
from inference_lab.serve.settings import startup_warnings

from .conftest import make_settings
from .test_serve_kv_events import decode_exact

_names = itertools.count()


def inproc() -> str:
    return f"inproc://kv-limits-{next(_names)}"


def start(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay_pair(ctx: Any, *, size: int, rate: float, slice_: int, pending: int) -> Any:
    """A ROUTER as the publisher sets it up, a buffer of ``size`` batches 0..size-1 and a
    :class:`ReplayService` on a test clock; returns (service, router, buffer, clock)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 2 * (size + 1))
    endpoint = inproc()
    router.bind(endpoint)
    buffer = ReplayBuffer(size)
    for seq in range(size):
        buffer.append(seq, b"batch %d" % seq)
    clock = Clock()
    service = ReplayService(
        router, zmq, b"topic", buffer, rate=rate, slice_=slice_, pending=pending, clock=clock
    )
    return service, router, endpoint, buffer, clock


def read_answer(dealer: Any, got: list[list[bytes]] | None = None) -> list[int]:
    """One whole replay answer on a DEALER (from the messages in ``got`` first): the
    sequence numbers, up to the end marker."""
    seqs = []
    while True:
        if got:
            frames = got.pop(0)
        else:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
        if frames[2] == END_SEQ:
            assert frames == [b"", b"", END_SEQ, b""]
            return seqs
        assert frames[1] == b"topic"
        seqs.append(int.from_bytes(frames[2], "big"))
        assert frames[3] == b"batch %d" % seqs[-1]


def test_the_replay_spends_no_more_than_its_tokens() -> None:
    """kv_replay Rule 3: with the clock stopped, any number of turns spends at most one
    slice of messages; the clock refills ``rate`` a second but the bucket holds one
    slice at most. A flood of 50 requests for the whole buffer is still answered whole,
    in order, eventually."""
    ctx = zmq.Context()
    try:
        service, router, endpoint, _, clock = replay_pair(
            ctx, size=100, rate=1000.0, slice_=50, pending=4
        )
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        for _ in range(50):
            dealer.send_multipart((b"", start(0)))
        for _ in range(1000):
            service.turn()
        stats = service.statistics()
        assert stats.requests + stats.replayed + stats.answered <= 50
        assert stats.requests == 4  # only `pending` taken at once
        clock.now = 10.0  # ten seconds idle: still one slice, no more
        for _ in range(1000):
            service.turn()
        stats = service.statistics()
        assert stats.requests + stats.replayed + stats.answered <= 2 * 50
        turns = 0
        got: list[list[bytes]] = []
        while service.statistics().answered < 50:
            clock.now += 0.01  # 10 tokens a turn
            service.turn()
            turns += 1
            while dealer.poll(0):
                got.append(dealer.recv_multipart())
        stats = service.statistics()
        assert stats.requests + stats.replayed + stats.answered <= 2 * 50 + 10 * turns
        answers = [read_answer(dealer, got) for _ in range(50)]
        assert all(a == list(range(100)) for a in answers)
        assert service.statistics().abandoned == 0
        assert service.turn() == float("inf")  # nothing left to answer
        dealer.close(linger=0)
        router.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_requests_being_answered_take_turns() -> None:
    """Round robin: a second requester's short answer is not queued behind a first
    requester's long one, it ends within a few slices."""
    ctx = zmq.Context()
    try:
        service, router, endpoint, _, clock = replay_pair(
            ctx, size=1000, rate=1e9, slice_=10, pending=4
        )
        first, second = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        first.connect(endpoint)
        second.connect(endpoint)
        first.send_multipart((b"", start(0)))  # 1,000 batches
        service.turn()  # takes it and sends a slice
        second.send_multipart((b"", start(990)))  # 10 batches
        turns = 0
        while service.statistics().answered < 1:
            clock.now += 1.0
            service.turn()
            turns += 1
        assert read_answer(second) == list(range(990, 1000))
        assert turns <= 6  # not the ~100 turns the first answer takes
        assert service.statistics().replayed < 200
        first.close(linger=0)
        second.close(linger=0)
        router.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_a_requester_that_does_not_read_loses_its_answers() -> None:
    """kv_replay Rule 4: the answers to a DEALER that never reads fill its queue (one
    whole replay, as vLLM sizes it, plus the DEALER's own), then the rest are cut short
    and counted: the server holds no more for it. Malformed requests are ignored."""
    ctx = zmq.Context()
    try:
        service, router, endpoint, _, clock = replay_pair(
            ctx, size=20, rate=1e9, slice_=1000, pending=64
        )
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", b"", b"not a request"))
        for _ in range(40):
            dealer.send_multipart((b"", start(0)))
        while service.statistics().requests < 41 or service.turn() != float("inf"):
            clock.now += 1.0
            service.turn()
        stats = service.statistics()
        assert stats.requests == 41
        assert stats.answered + stats.abandoned == 40
        assert stats.abandoned > 30
        assert stats.replayed <= 2 * 21 + 1 + 20  # the queue's worth, then one cut short
        dealer.close(linger=0)
        router.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_the_buffer_skips_what_it_no_longer_holds() -> None:
    """kv_replay Rule 2: sequence numbers past the buffer's size are forgotten, dropped
    ones (never appended) are skipped."""
    buffer = ReplayBuffer(4)
    for seq in (0, 1, 2, 4, 5, 6):  # 3 was dropped before it was sent
        buffer.append(seq, b"%d" % seq)
    assert (buffer.start, buffer.end) == (3, 7)
    assert [seq for seq, _ in buffer] == [4, 5, 6]
    assert buffer.get(2) is None and buffer.get(3) is None and buffer.get(6) == b"6"


async def test_live_batches_flow_through_a_replay_flood() -> None:
    """A flood of replay requests for the whole buffer, from a requester that never
    reads, against a publisher whose replay is slow (100 messages a second): a live batch
    published after the flood arrives while the flood is still being taken (the thread
    drains the live queue between two replay turns)."""
    dep = make_settings().deployments[0]
    ctx = zmq.Context()
    limits = ReplayLimits(rate=100.0, slice_=10, pending=4)
    publisher = ModelPublisher(
        dep, inproc(), inproc(), "", ctx, buffer_steps=500, replay_limits=limits
    )
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        for k in range(500):
            publisher.publish((BlockRemoved(worker=0, block_hashes=(k,)),))
        flood = ctx.socket(zmq.DEALER)
        flood.connect(publisher.replay_endpoint or "")
        for _ in range(2000):
            flood.send_multipart((b"", start(0)))
        publisher.start()
        with trio.fail_after(10):
            while publisher.statistics().sent < 500:  # noqa: ASYNC110 - another thread's count
                await trio.sleep(0.01)
            publisher.publish((BlockRemoved(worker=0, block_hashes=(12345,)),))
            while True:
                await trio.to_thread.run_sync(sub.poll, 1000)
                _, seq, payload = sub.recv_multipart()
                if int.from_bytes(seq, "big") == 500:
                    break
        assert decode_exact(payload).events[0].block_hashes == [12345]  # type: ignore[union-attr]
        assert publisher.statistics().replay_requests < 2000
        sub.close(linger=0)
        flood.close(linger=0)
    finally:
        await trio.to_thread.run_sync(publisher.close)
        ctx.destroy(linger=0)


def test_a_subscriber_that_never_reads_is_held_to_the_high_water_mark() -> None:
    """Rule 4: the PUB socket queues at most its high-water mark for a subscriber that
    does not read and drops the rest (over ``inproc`` the queue is exactly the PUB's mark
    plus the SUB's). Without the mark all 500 would wait in the server's memory."""
    dep = make_settings().deployments[0]
    ctx = zmq.Context()
    publisher = ModelPublisher(dep, inproc(), None, "", ctx, hwm=50)
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 10)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        for k in range(500):
            publisher.publish((BlockRemoved(worker=0, block_hashes=(k,)),))
        publisher._drain()  # the thread's work, done here: all 500 sent, none blocked on
        assert publisher.statistics().sent == 500
        got = 0
        while sub.poll(200):
            sub.recv_multipart()
            got += 1
        assert 50 <= got <= 60
        sub.close(linger=0)
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_remembered_streams_are_forgotten_once_stored() -> None:
    """Rule 5: a hash named by two admissions survives one store of it and is forgotten
    at the second; a hash only hit (never stored) waits for the table's bound."""
    dep = make_settings().deployments[0]
    ctx = zmq.Context()
    publisher = ModelPublisher(dep, inproc(), None, "", ctx)
    try:
        tokens = np.arange(3 * 64, dtype=np.int64)
        publisher.remember((11, 12, 13), tokens)
        publisher.remember((11, 12), tokens[:128])
        stored = BlockStored(worker=0, block_hashes=(11, 12), parent_block_hash=None)
        publisher.publish((stored,))
        publisher._drain()
        assert {h: e[2] for h, e in publisher._remembered.items()} == {11: 1, 12: 1, 13: 1}
        publisher.publish((BlockStored(worker=1, block_hashes=(11, 12), parent_block_hash=None),))
        publisher._drain()
        assert list(publisher._remembered) == [13]  # only hit: kept until the bound
        assert publisher.statistics().missing_tokens == 0
        publisher._remember_cap = 1
        publisher.remember((21, 22), tokens[:128])
        publisher._take_admitted()
        assert list(publisher._remembered) == [22]
    finally:
        publisher.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    ("endpoint", "replay", "exposed"),
    [
        ("tcp://127.0.0.1:*", "tcp://127.0.0.1:5558", []),
        ("tcp://[::1]:*", None, []),
        ("tcp://localhost:*", None, []),
        ("tcp://*:5557", None, ["tcp://*:5557"]),
        ("tcp://[::]:5557", None, ["tcp://[::]:5557"]),
        ("tcp://10.1.2.3:*", None, ["tcp://10.1.2.3:*"]),
        ("tcp://indexer:5557", None, []),  # connected, not bound (vLLM's rule)
        ("tcp://0.0.0.0:5557", None, []),  # connected too: no '*' and no '::'
        ("tcp://127.0.0.1:*", "tcp://0.0.0.0:5558", ["tcp://0.0.0.0:5558"]),
        ("tcp://127.0.0.1:*", "tcp://*:5558", ["tcp://*:5558"]),
        ("ipc:///tmp/kv", "inproc://replay", []),
    ],
)
def test_endpoints_bound_beyond_loopback_are_warned_about(
    endpoint: str, replay: str | None, exposed: list[str]
) -> None:
    kv = KVEventsSettings(endpoint=endpoint, replay_endpoint=replay)
    warnings = exposure_warnings(kv)
    assert len(warnings) == len(exposed)
    for line, value in zip(warnings, exposed, strict=True):
        assert line.startswith(f"KV events bound on {value}: ")
        assert "token ids (the prompts' text)" in line and "docs/security.md" in line
    settings = attrs.evolve(make_settings(), kv_events=kv)
    assert [w for w in startup_warnings(settings, "127.0.0.1") if "KV events" in w] == warnings


def test_the_warning_says_what_is_exposed_without_token_ids() -> None:
    kv = KVEventsSettings(endpoint="tcp://*:5557", token_ids=False)
    (line,) = exposure_warnings(kv)
    assert "block hashes" in line and "token ids" not in line
    assert exposure_warnings(None) == []
