"""KV-cache events over ZeroMQ (:mod:`inference_lab.serve.kv_events`), against real
sockets: a pyzmq subscriber decodes every batch -- live and replayed -- with msgspec
structs that mirror vLLM's own declarations, checks each one re-encodes to the very bytes
received (field for field, defaults and omissions included), and rebuilds each replica's
set of cached blocks from them, which must equal the engine's.

These tests run on trio's real clock (the app paces to wall-clock; the publisher is a
thread with real sockets), each bounded by ``trio.fail_after``.
"""

from __future__ import annotations

from typing import Any

import attrs
import msgspec
import pytest
import trio
import zmq

from inference_lab.core.engine import AllBlocksCleared, BlockRemoved, BlockStored
from inference_lab.errors import ConfigError
from inference_lab.serve import load_settings
from inference_lab.serve.kv_events import (
    END_SEQ,
    KVEventsSettings,
    ModelPublisher,
    check_endpoint,
    offset_endpoint,
)
from inference_lab.serve.kv_wire import VLLM_COMMIT, VLLM_RELEASE
from inference_lab.serve.settings_env import settings_from_env
from inference_lab.traffic.hashing import ROOT, block_hash

from .conftest import CONFIG_FILES, GPT, Served, ServeFactory, make_settings

TOPIC = "kv@test@{model}"

# -- vLLM's declarations, mirrored -------------------------------------------------------------
# As declared in vllm/distributed/kv_events.py of vLLM 0.34.0 (commit 62d4bc3c7, read from
# the release's wheel): the batch is array_like, the events are tagged maps (vLLM dropped
# array_like from KVCacheEvent), both omit_defaults. ExternalBlockHash is ``bytes | int``.
MIRRORED = ("0.34.0", "62d4bc3c7")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class WireStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[WireStored | WireRemoved | WireCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def ordered(value: Any) -> Any:
    """A decoded msgpack value with every map as its list of (key, value) in wire order."""
    if isinstance(value, dict):
        return [(k, ordered(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [ordered(v) for v in value]
    return value


def decode_exact(payload: bytes) -> KVEventBatch:
    """Decode a payload with vLLM's declarations; re-encoded by msgspec as vLLM encodes
    it, it must be the same msgpack value, map keys in the same order: the payload
    carries exactly the fields vLLM would send for these values, in vLLM's order (the
    width of a map's header may differ: msgspec writes a struct's as map16)."""
    batch = DECODER.decode(payload)
    theirs = msgspec.msgpack.decode(ENCODER.encode(batch))
    assert ordered(msgspec.msgpack.decode(payload)) == ordered(theirs)
    for event in batch.events:
        if isinstance(event, WireStored):
            # a LoRA adapter's blocks: its id, its name, its name as each block's extra key
            lora = event.lora_name
            keys = [None if lora is None else (lora,)] * len(event.block_hashes)
            assert event.extra_keys == keys
            assert (event.lora_id is None) == (lora is None)
            assert (event.group_idx, event.kv_cache_spec_kind) == (0, "full_attention")
            assert event.medium == "GPU"
        elif isinstance(event, WireRemoved):
            assert (event.group_idx, event.medium) == (0, "GPU")
    return batch


def test_the_mirror_names_the_release_the_wire_follows() -> None:
    assert (VLLM_RELEASE, VLLM_COMMIT) == MIRRORED


class Subscriber:
    """A KV-event consumer as llm-d's or Dynamo's: a SUB socket on the topic, a DEALER on
    the replay socket; it keeps each rank's set of cached hashes and fills any gap in the
    sequence from the replay. Every batch goes through :func:`decode_exact`."""

    def __init__(
        self, ctx: Any, endpoint: str, replay: str, topic: bytes, *, token_ids: bool = True
    ) -> None:
        self.ctx = ctx
        self.token_ids = token_ids
        self.endpoint = endpoint
        self.topic = topic
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.sub: Any = None
        self.last = -1
        self.cached: dict[int, set[int]] = {}
        self.replayed = 0
        self.kinds: dict[str, int] = {}
        self.block_size: int | None = None
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def disconnect(self) -> None:
        self.sub.close(linger=0)

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.last + 1, (seq, self.last)
        self.last = seq
        batch = decode_exact(payload)
        assert batch.data_parallel_rank is not None
        rank = self.cached.setdefault(batch.data_parallel_rank, set())
        for event in batch.events:
            self.kinds[type(event).__name__] = self.kinds.get(type(event).__name__, 0) + 1
            if isinstance(event, WireStored):
                assert all(isinstance(h, int) for h in event.block_hashes)  # 64-bit, as vLLM's
                if self.token_ids:
                    check_token_ids(event)
                else:
                    assert event.token_ids == []
                self.block_size = event.block_size
                rank.update(event.block_hashes)
            elif isinstance(event, WireRemoved):
                assert set(event.block_hashes) <= rank
                rank.difference_update(event.block_hashes)
            else:
                rank.clear()

    def fill_gap(self, upto: int) -> None:
        """Ask the replay socket for every batch after the last one applied (vLLM's
        answer: ``[b"", topic, seq, payload]`` frames, then ``[b"", b"", -1, b""]``)."""
        self.replay.send_multipart((b"", (self.last + 1).to_bytes(8, "big")))
        while True:
            assert self.replay.poll(5000), "no replay answer"
            frames = self.replay.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            topic, seq_bytes, payload = frames[1:]
            if seq_bytes == END_SEQ:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == self.topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last:
                self.apply(seq, payload)
                self.replayed += 1
        assert self.last >= upto - 1

    def take(self, timeout_ms: int) -> bool:
        """Read one message if one comes within ``timeout_ms``; fill a gap first."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == self.topic
        seq = int.from_bytes(seq_bytes, "big")
        if seq <= self.last:
            return True  # already replayed
        if seq > self.last + 1:
            self.fill_gap(seq)
        if seq == self.last + 1:
            self.apply(seq, payload)
        return True


def check_token_ids(event: WireStored) -> None:
    """A stored run's token ids hash to its block hashes (Rule 4 of api/hashing.py)."""
    bs = event.block_size
    assert len(event.token_ids) == bs * len(event.block_hashes)
    parent: Any = event.parent_block_hash if event.parent_block_hash is not None else ROOT
    for i, h in enumerate(event.block_hashes):
        ids = event.token_ids[i * bs : (i + 1) * bs]
        content = b"".join(t.to_bytes(8, "little", signed=True) for t in ids)
        assert block_hash(parent, content) == h
        parent = h


def engine_cached(s: Served) -> dict[int, set[int]]:
    """Each replica's cached hashes, held or evictable, as the engine has them."""
    return {i: set(w.pool.ref) for i, w in enumerate(s.runtime().engine.workers)}


async def catch_up(s: Served, sub: Subscriber) -> None:
    """Read until the subscriber has every batch the publisher numbered."""
    publisher = s.state.kv_events.publishers[GPT]  # type: ignore[union-attr]
    with trio.fail_after(10):
        while sub.last < (batches := publisher.statistics().batches) - 1:
            if not await trio.to_thread.run_sync(sub.take, 200):
                # nothing more live (what went out before the subscription took hold is
                # lost to it): ask the replay socket
                await trio.to_thread.run_sync(sub.fill_gap, batches)


def kv_settings(blocks: int, *, token_ids: bool = True) -> Any:
    """gpt-oss-20b on two replicas (data-parallel ranks 0 and 1, round robin) of
    ``blocks`` KV blocks each, publishing on loopback."""
    settings = make_settings()
    dep = settings.deployments[0]
    dep = attrs.evolve(
        dep,
        scheduler=attrs.evolve(dep.scheduler, kv_cache_capacity=blocks * dep.block_bytes),
        hardware=attrs.evolve(dep.hardware, replicas=2),
    )
    return attrs.evolve(
        settings,
        deployments=(dep,),
        enable_test_harness=True,
        kv_events=KVEventsSettings(
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            topic=TOPIC,
            token_ids=token_ids,
        ),
    )


async def send(s: Served, prompt: str, max_tokens: int = 70) -> None:
    body = {
        "model": GPT,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
    }
    response = await s.post("/v1/chat/completions", body)
    assert response.status_code == 200, await response.get_data()


async def test_a_subscriber_rebuilds_the_cache_from_events_and_replay(serve: ServeFactory) -> None:
    """Stores, evictions (caches of 24 blocks), a gap while the subscriber is away
    (filled from the replay socket) and a restart (AllBlocksCleared), on two replicas:
    after each phase the subscriber's picture of every rank -- 0 and 1 -- equals the
    engine's cached hashes, and each stored run's token ids hash to its block hashes.
    Every batch, live or replayed, decodes with vLLM's declarations to its own bytes."""
    ctx = zmq.Context()
    try:
        with trio.fail_after(60):
            async with serve(kv_settings(24)) as s:
                publisher = s.state.kv_events.publishers[GPT]  # type: ignore[union-attr]
                sub = Subscriber(
                    ctx,
                    publisher.endpoint,
                    publisher.replay_endpoint or "",
                    TOPIC.replace("{model}", GPT).encode(),
                )
                prompts = [f"conversation {k}: " + "tell me more " * 150 for k in range(6)]
                for p in prompts[:3]:
                    await send(s, p)
                await send(s, prompts[0])  # a resend: hits, stores its answer's blocks
                await catch_up(s, sub)
                assert sub.cached == engine_cached(s)
                assert set(sub.cached) == {0, 1}
                assert sub.kinds.get("WireStored", 0) > 0

                sub.disconnect()  # away: what is published now is a gap
                for p in prompts[3:]:
                    await send(s, p)
                sub.connect()
                await send(s, prompts[1])
                await catch_up(s, sub)
                assert sub.replayed > 0
                assert sub.kinds.get("WireRemoved", 0) > 0  # 24 blocks do not hold it all
                assert sub.cached == engine_cached(s)
                assert sub.block_size == 64

                response = await s.post("/control/engine", {"model": GPT, "action": "restart"})
                assert response.status_code == 200
                await send(s, prompts[2])
                await catch_up(s, sub)
                assert sub.kinds.get("WireCleared", 0) == 2  # one per rank
                assert sub.cached == engine_cached(s)
                stats = publisher.statistics()
                assert stats.dropped == 0 and stats.missing_tokens == 0
            sub.disconnect()
            sub.replay.close(linger=0)
    finally:
        ctx.destroy(linger=0)


async def test_without_token_ids_every_store_goes_out_with_none(serve: ServeFactory) -> None:
    """``--kv-events-no-token-ids``: every BlockStored still decodes with vLLM's
    declarations (``token_ids`` is declared without a default) but carries none, the
    subscriber's picture is still the engine's, and no stream is remembered."""
    ctx = zmq.Context()
    try:
        with trio.fail_after(60):
            async with serve(kv_settings(24, token_ids=False)) as s:
                publisher = s.state.kv_events.publishers[GPT]  # type: ignore[union-attr]
                sub = Subscriber(
                    ctx,
                    publisher.endpoint,
                    publisher.replay_endpoint or "",
                    TOPIC.replace("{model}", GPT).encode(),
                    token_ids=False,
                )
                for k in range(3):
                    await send(s, f"secret {k}: " + "my password is hunter2 " * 40)
                await catch_up(s, sub)
                assert sub.kinds.get("WireStored", 0) > 0
                assert sub.cached == engine_cached(s)
                assert len(publisher._remembered) == 0 and len(publisher._admitted) == 0
                assert publisher.statistics().missing_tokens == 0
                assert s.state.kv_events.describe()[0].endswith(", without token ids")  # type: ignore[union-attr]
            sub.disconnect()
            sub.replay.close(linger=0)
    finally:
        ctx.destroy(linger=0)


async def test_a_full_queue_drops_the_oldest_batches_as_a_gap() -> None:
    """Rule 4: the engine task never waits: past the queue's size the oldest batch is
    dropped and counted; the survivors keep their sequence numbers, so a subscriber sees
    the gap, and the replay cannot fill it."""
    dep = make_settings().deployments[0]
    ctx = zmq.Context()
    publisher = ModelPublisher(dep, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "", ctx, queue_size=2)
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        for k in range(5):  # the thread is not running yet: the queue fills
            publisher.publish((BlockRemoved(worker=0, block_hashes=(k,)),))
        stats = publisher.statistics()
        assert (stats.batches, stats.dropped) == (5, 3)
        replay = ctx.socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint or "")
        publisher.start()
        with trio.fail_after(10):
            while publisher.statistics().sent < 2:
                await trio.to_thread.run_sync(sub.poll, 50)
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        got = []
        with trio.fail_after(10):
            while True:
                await trio.to_thread.run_sync(replay.poll, 5000)
                frames = replay.recv_multipart()
                if frames[2] == END_SEQ:
                    break
                assert frames[1] == b""  # the topic
                decode_exact(frames[3])
                got.append(int.from_bytes(frames[2], "big"))
        assert got == [3, 4]
        # (the publisher's thread counts a message after sending it: no event to await)
        with trio.fail_after(10):
            while (stats := publisher.statistics()).replays < 1:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert (stats.replay_requests, stats.replays, stats.replayed) == (1, 1, 2)
        sub.close(linger=0)
        replay.close(linger=0)
    finally:
        await trio.to_thread.run_sync(publisher.close)
        ctx.destroy(linger=0)


def test_one_batch_per_replica_in_order() -> None:
    """A wake-up's events are split by replica (vLLM's data-parallel rank), each batch
    keeping its events' order."""
    dep = make_settings().deployments[0]
    ctx = zmq.Context()
    publisher = ModelPublisher(dep, "tcp://127.0.0.1:*", None, "", ctx)
    try:
        publisher.publish(
            (
                BlockStored(worker=1, block_hashes=(1, 2), parent_block_hash=None),
                BlockRemoved(worker=0, block_hashes=(9,)),
                AllBlocksCleared(worker=1),
            )
        )
        queued = list(publisher._queue)
        assert [(seq, worker) for seq, _, worker, _ in queued] == [(0, 1), (1, 0)]
        assert [type(e).__name__ for e in queued[0][3]] == ["BlockStored", "AllBlocksCleared"]
        payload = publisher._encoder.encode(
            [queued[0][1], [publisher._event(e) for e in queued[0][3]], 1]
        )
        batch = decode_exact(payload)
        assert batch.data_parallel_rank == 1
        stored = batch.events[0]
        assert isinstance(stored, WireStored) and stored.token_ids == []  # never remembered
        assert (stored.block_hashes, stored.parent_block_hash, stored.block_size) == (
            [1, 2],
            None,
            64,
        )
        assert isinstance(batch.events[1], WireCleared)
        assert publisher.statistics().missing_tokens == 1
    finally:
        publisher.close()
        ctx.destroy(linger=0)


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5557", "tcp://*:5557", "tcp://[::1]:5557", "ipc:///tmp/kv", "inproc://kv"],
)
def test_endpoints_that_zeromq_takes(endpoint: str) -> None:
    assert check_endpoint(endpoint, "--kv-events-endpoint") == endpoint


@pytest.mark.parametrize(
    "endpoint", ["127.0.0.1:5557", "tcp://host", "udp://x:1", "tcp://h:99999x"]
)
def test_a_bad_endpoint_is_one_line_naming_the_flag(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="^--kv-events-endpoint: .* is not a ZeroMQ endpoint"):
        load_settings(
            config=CONFIG_FILES[GPT],
            kv_events_endpoint=endpoint,
            labels={"kv_events_endpoint": "--kv-events-endpoint"},
        )


def test_a_replay_endpoint_needs_an_endpoint() -> None:
    with pytest.raises(ConfigError, match="kv_events_replay_endpoint: needs kv_events_endpoint"):
        load_settings(config=CONFIG_FILES[GPT], kv_events_replay_endpoint="tcp://*:5558")


def test_no_token_ids_needs_an_endpoint_and_reaches_the_settings() -> None:
    with pytest.raises(ConfigError, match="^--kv-events-no-token-ids: needs --kv-events-endpoint"):
        load_settings(
            config=CONFIG_FILES[GPT],
            kv_events_no_token_ids=True,
            labels={
                "kv_events_no_token_ids": "--kv-events-no-token-ids",
                "kv_events_endpoint": "--kv-events-endpoint",
            },
        )
    settings = load_settings(
        config=CONFIG_FILES[GPT], kv_events_endpoint="tcp://*:5557", kv_events_no_token_ids=True
    )
    assert settings.kv_events == KVEventsSettings(endpoint="tcp://*:5557", token_ids=False)


def test_the_environment_names_the_same_settings() -> None:
    env = {
        "INFERENCE_LAB_CONFIG": str(CONFIG_FILES[GPT]),
        "INFERENCE_LAB_KV_EVENTS_ENDPOINT": "tcp://*:5557",
        "INFERENCE_LAB_KV_EVENTS_REPLAY_ENDPOINT": "tcp://*:5558",
        "INFERENCE_LAB_KV_EVENTS_TOPIC": "kv@{model}",
    }
    assert settings_from_env(env).kv_events == KVEventsSettings(
        endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", topic="kv@{model}"
    )
    quiet = settings_from_env({**env, "INFERENCE_LAB_KV_EVENTS_NO_TOKEN_IDS": "1"}).kv_events
    assert quiet is not None and not quiet.token_ids
    with pytest.raises(ConfigError, match="^INFERENCE_LAB_KV_EVENTS_ENDPOINT: "):
        settings_from_env({**env, "INFERENCE_LAB_KV_EVENTS_ENDPOINT": "nope"})


def test_each_model_gets_its_own_ports() -> None:
    """Rule 1: the k-th published model's TCP ports are the given ones plus k."""
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    assert offset_endpoint("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"  # as vLLM
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_1"


def test_a_port_in_use_is_a_startup_error() -> None:
    """Binding happens when the app's state is built: a port in use (here the replay
    socket's, which is always bound) is one ConfigError naming the model and the
    endpoint."""
    from inference_lab.serve import create_app

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    try:
        taken.bind("tcp://127.0.0.1:*")
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        kv = KVEventsSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint=endpoint)
        settings = attrs.evolve(make_settings(), kv_events=kv)
        with pytest.raises(ConfigError, match=f"KV events of {GPT}: cannot use {endpoint}: "):
            create_app(settings)
    finally:
        taken.close(linger=0)
        ctx.destroy(linger=0)


async def test_models_without_prefix_caching_publish_nothing(serve: ServeFactory) -> None:
    settings = attrs.evolve(
        make_settings(enable_prefix_caching=False),
        kv_events=KVEventsSettings(endpoint="tcp://127.0.0.1:*"),
    )
    async with serve(settings) as s:
        assert s.state.kv_events is not None and s.state.kv_events.publishers == {}
        assert s.runtime().kv_events is None
        await send(s, "same " * 300)
        await send(s, "same " * 300)
        assert s.runtime().engine.take_kv_events() == ()
