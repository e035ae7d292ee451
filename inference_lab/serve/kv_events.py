"""KV-cache events over ZeroMQ, in vLLM's layout (opt-in: ``--kv-events-endpoint``).

What a served model's prefix caches do -- blocks stored, blocks evicted, every block
dropped -- published as vLLM publishes it, so a KV-aware router (llm-d's KV-cache
indexer, Dynamo's KV router) can follow this server as it follows vLLM. Needs the
``kv-events`` extra (pyzmq and msgspec).

Rule 1: one publisher per model whose deployment caches prefixes: a PUB socket on the
        endpoint -- bound when the endpoint has a wildcard (``*``) or ``::`` or is
        ``ipc://`` / ``inproc://``, connected otherwise (vLLM's rule) -- and, with a
        replay endpoint, a ROUTER socket bound there. With several such models the
        ``k``-th one's TCP ports are the given ones plus ``k`` (``ipc`` / ``inproc``
        names get ``_k`` appended), as vLLM offsets a data-parallel rank's.
Rule 2: every message is three frames, as vLLM's: the topic (UTF-8; ``{model}`` in it is
        replaced by the model's name), the sequence number (8 bytes, big-endian, from 0
        per model), the payload: the msgpack of the batch ``[ts, [event, ...], rank]``
        (``ts`` Unix seconds; ``rank``, vLLM's data-parallel rank, is the replica), each
        event a map tagged by ``type``: ``BlockStored`` (``block_hashes``,
        ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
        ``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``),
        ``AllBlocksCleared``. One batch per replica per engine wake-up that changed it.
Rule 3: replay, as vLLM answers it: a request ``[identity, b"", start]`` on the ROUTER
        (``start`` 8 bytes, big-endian) gets ``[identity, b"", seq, payload]`` for every
        batch still buffered (the last :data:`BUFFER_STEPS`) with ``seq >= start``, in
        order, then ``[identity, b"", -1 as 8 signed bytes, b""]``.
Rule 4: the engine task never waits on a subscriber: :meth:`ModelPublisher.publish`
        numbers the batch and appends it to a bounded queue (the oldest is dropped when
        it is full, and counted); one thread per publisher owns the sockets, encodes,
        sends (a PUB socket drops, never blocks, for a slow subscriber) and answers
        replays. A dropped batch is a gap in the sequence that replay cannot fill.
Rule 5: a stored block's token ids come from the streams the requests were hashed with
        (:meth:`ModelPublisher.remember`, a bounded table of recent hashes); a block
        whose request was forgotten goes out with no token ids (counted).
"""

from __future__ import annotations

import collections
import importlib
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from inference_lab.core.config import Deployment
from inference_lab.core.engine import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from inference_lab.errors import ConfigError

__all__ = [
    "BUFFER_STEPS",
    "END_SEQ",
    "QUEUE_SIZE",
    "KVEventsSettings",
    "KVEventsHub",
    "ModelPublisher",
    "PublisherStatistics",
    "check_endpoint",
    "offset_endpoint",
]

#: Batches kept for replay (vLLM's ``buffer_steps`` default).
BUFFER_STEPS = 10_000
#: Batches waiting for the publisher thread; past this the oldest is dropped (Rule 4).
QUEUE_SIZE = 100_000
#: The PUB socket's high-water mark (vLLM's default).
HWM = 100_000
#: The replay's end marker (Rule 3).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: How long the publisher thread sleeps between looks at the replay socket (seconds).
REPLAY_POLL = 0.02
#: Hashes remembered per model for token ids (Rule 5), at least this many.
MIN_REMEMBERED = 1 << 16
_MEDIUM = "GPU"
_ENDPOINT = re.compile(r"(tcp://(\*|\[[^\]]+\]|[^:/\s]+):(\*|\d{1,5})|(ipc|inproc)://\S+)")


@attrs.frozen(kw_only=True)
class KVEventsSettings:
    """``--kv-events-endpoint``, ``--kv-events-replay-endpoint``, ``--kv-events-topic``."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def check_endpoint(value: str, label: str) -> str:
    """A ZeroMQ endpoint as the flags take it: ``tcp://HOST:PORT`` (HOST ``*`` binds every
    address, PORT ``*`` any free port), ``ipc://PATH`` or ``inproc://NAME``; ConfigError
    naming ``label`` otherwise."""
    if not _ENDPOINT.fullmatch(value):
        raise ConfigError(
            f"{label}: {value!r} is not a ZeroMQ endpoint "
            "(tcp://HOST:PORT, tcp://*:PORT, ipc://PATH or inproc://NAME)"
        )
    return value


def offset_endpoint(endpoint: str, k: int) -> str:
    """The ``k``-th model's endpoint (Rule 1)."""
    if k == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return endpoint if port == "*" else f"{head}:{int(port) + k}"
    return f"{endpoint}_{k}"


def binds(endpoint: str) -> bool:
    """vLLM's rule (Rule 1): bind a wildcard, ``::``, ``ipc://`` or ``inproc://``."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def _modules() -> tuple[Any, Any]:
    try:
        zmq = importlib.import_module("zmq")
        msgspec = importlib.import_module("msgspec")
    except ImportError:
        raise ConfigError(
            "--kv-events-endpoint needs the 'pyzmq' and 'msgspec' packages "
            "(pip install 'inference-lab[kv-events]')"
        ) from None
    return zmq, msgspec


@attrs.frozen(kw_only=True)
class PublisherStatistics:
    """One model's publisher, for ``/control/stats`` and tests."""

    #: Where subscribers connect (or where the server connected), as bound.
    endpoint: str
    replay_endpoint: str | None
    #: Batches numbered so far (the next sequence number).
    batches: int
    #: Batches sent on the PUB socket.
    sent: int
    #: Batches dropped from a full queue (gaps; Rule 4).
    dropped: int
    #: Blocks stored whose token ids were no longer remembered (Rule 5).
    missing_tokens: int
    #: Replay requests answered.
    replays: int


class ModelPublisher:
    """The KV-event publisher of one model (see the module rules). Built (and its
    sockets bound) by :class:`KVEventsHub`; :meth:`start` runs its thread, :meth:`close`
    ends it."""

    def __init__(
        self,
        deployment: Deployment,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        ctx: Any,
        *,
        queue_size: int = QUEUE_SIZE,
        buffer_steps: int = BUFFER_STEPS,
    ) -> None:
        zmq, msgspec = _modules()
        self._zmq = zmq
        self._encoder = msgspec.msgpack.Encoder()
        self.model = deployment.model.name
        self.block_size = deployment.scheduler.block_size
        self.topic = topic.replace("{model}", self.model).encode("utf-8")
        self._queue: collections.deque[tuple[int, float, int, tuple[KVEvent, ...]]] = (
            collections.deque()
        )
        self._queue_size = queue_size
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        cap = max(MIN_REMEMBERED, 2 * deployment.total_blocks * deployment.workers)
        self._remembered: collections.OrderedDict[int, tuple[Any, int]] = collections.OrderedDict()
        self._remember_cap = cap
        self._seq = 0
        self._sent = 0
        self._dropped = 0
        self._missing = 0
        self._replays = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(HWM)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        try:
            self.bound = binds(endpoint)
            if self.bound:
                pub.bind(endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
                self.endpoint = endpoint
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(replay_endpoint)
                self.replay_endpoint: str | None = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self.replay_endpoint = None
        except zmq.ZMQError as exc:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            where = replay_endpoint if replay is not None else endpoint
            raise ConfigError(f"KV events of {self.model}: cannot use {where}: {exc}") from None
        self._pub = pub
        self._replay = replay

    # -- the serving side (trio's thread) ------------------------------------------------
    def remember(self, hashes: Sequence[int], tokens: Any) -> None:
        """The stream ``tokens`` (ids, numpy) a request was hashed with, its chain
        ``hashes`` (Rule 5). Called at admission, only while publishing."""
        table = self._remembered
        for i, h in enumerate(hashes):
            table[h] = (tokens, i)
            table.move_to_end(h)
        while len(table) > self._remember_cap:
            table.popitem(last=False)

    def publish(self, events: Iterable[KVEvent]) -> None:
        """Queue the events of one engine wake-up: one numbered batch per replica, in the
        order they happened (Rule 4). Synchronous, never waits."""
        by_worker: dict[int, list[KVEvent]] = {}
        for event in events:
            by_worker.setdefault(event.worker, []).append(event)
        ts = time.time()
        queue = self._queue
        for worker, batch in by_worker.items():
            if len(queue) >= self._queue_size:
                queue.popleft()
                self._dropped += 1
            queue.append((self._seq, ts, worker, tuple(batch)))
            self._seq += 1
        self._wake.set()

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            batches=self._seq,
            sent=self._sent,
            dropped=self._dropped,
            missing_tokens=self._missing,
            replays=self._replays,
        )

    def start(self) -> None:
        """Start the publisher thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kv-events {self.model}", daemon=True
            )
            self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, end the thread, close the sockets. Blocking (up to
        ``timeout``): the app calls it from a worker thread when it stops."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    # -- the publisher thread ------------------------------------------------------------
    def _run(self) -> None:
        wake = self._wake
        while True:
            wake.wait(REPLAY_POLL)
            wake.clear()
            self._drain()
            if self._replay is not None:
                self._serve_replays()
            if self._stopping and not self._queue:
                return

    def _drain(self) -> None:
        zmq = self._zmq
        queue = self._queue
        while queue:
            try:
                seq, ts, worker, events = queue.popleft()
            except IndexError:
                return
            payload = self._encoder.encode([ts, [self._event(e) for e in events], worker])
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart(
                    (self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                )
                self._sent += 1
            except zmq.Again:
                pass  # no peer ready (a connecting socket): replay still has it

    def _event(self, event: KVEvent) -> dict[str, Any]:
        if isinstance(event, BlockStored):
            return {
                "type": "BlockStored",
                "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash,
                "token_ids": self._token_ids(event.block_hashes),
                "block_size": self.block_size,
                "lora_id": None,
                "medium": _MEDIUM,
                "lora_name": None,
            }
        if isinstance(event, BlockRemoved):
            return {
                "type": "BlockRemoved",
                "block_hashes": list(event.block_hashes),
                "medium": _MEDIUM,
            }
        assert isinstance(event, AllBlocksCleared)
        return {"type": "AllBlocksCleared"}

    def _token_ids(self, hashes: Sequence[int]) -> list[int]:
        table = self._remembered
        bs = self.block_size
        parts = []
        for h in hashes:
            entry = table.get(h)
            if entry is None:
                self._missing += 1
                return []
            tokens, i = entry
            parts.append(tokens[i * bs : (i + 1) * bs])
        ids: list[int] = np.concatenate(parts).tolist()
        return ids

    def _serve_replays(self) -> None:
        zmq = self._zmq
        replay = self._replay
        assert replay is not None
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request (vLLM ignores it too)
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self._replays += 1
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        replay.send_multipart(
                            (identity, b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                        )
                replay.send_multipart((identity, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                continue  # the requester is gone


class KVEventsHub:
    """The publishers of one app (Rule 1): built with the app's state (sockets bound, so
    a port in use is a startup error), started and closed with its runtimes."""

    def __init__(self, settings: KVEventsSettings, deployments: Sequence[Deployment]) -> None:
        zmq, _ = _modules()
        self._ctx = zmq.Context()
        self.publishers: dict[str, ModelPublisher] = {}
        caching = [d for d in deployments if d.scheduler.enable_prefix_caching]
        try:
            for k, dep in enumerate(caching):
                replay = settings.replay_endpoint
                self.publishers[dep.model.name] = ModelPublisher(
                    dep,
                    offset_endpoint(settings.endpoint, k),
                    offset_endpoint(replay, k) if replay is not None else None,
                    settings.topic,
                    self._ctx,
                )
        except BaseException:
            self.close()
            raise

    def sink(self, model: str) -> Callable[[tuple[KVEvent, ...]], None] | None:
        """What model ``model``'s runtime hands its events to (None: not published)."""
        publisher = self.publishers.get(model)
        return publisher.publish if publisher is not None else None

    def start(self) -> None:
        for publisher in self.publishers.values():
            publisher.start()

    def close(self) -> None:
        """End every publisher (blocking, briefly) and the ZeroMQ context."""
        for publisher in self.publishers.values():
            publisher.close()
        self._ctx.destroy(linger=0)

    def describe(self) -> list[str]:
        """One banner line per published model."""
        lines = []
        for name, p in self.publishers.items():
            how = "on" if p.bound else "connected to"
            replay = f", replay on {p.replay_endpoint}" if p.replay_endpoint else ""
            lines.append(f"  KV events of {name}: {how} {p.endpoint}{replay}")
        return lines
