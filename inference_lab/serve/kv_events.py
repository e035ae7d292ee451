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
        per model), the payload: the msgpack of the batch in vLLM's layout
        (:mod:`inference_lab.serve.kv_wire`), ``rank`` (vLLM's data-parallel rank) being
        the replica. One batch per replica per engine wake-up that changed it.
Rule 3: replay is vLLM's protocol, served at a bounded rate in turns between two drains
        of the live queue (:mod:`inference_lab.serve.kv_replay`), from the last
        :data:`BUFFER_STEPS` sequence numbers.
Rule 4: the engine task never waits on a subscriber: :meth:`ModelPublisher.publish`
        numbers the batch and appends it to a bounded queue (the oldest is dropped when
        it is full, and counted); one thread per publisher owns the sockets, encodes,
        sends (a PUB socket drops, never blocks, for a subscriber :data:`HWM` messages
        behind) and answers replays. A dropped batch is a gap in the sequence that
        replay cannot fill.
Rule 5: a stored block's token ids come from the streams the requests were hashed with
        (:meth:`ModelPublisher.remember`, at admission): the publisher thread keeps, per
        hash, the latest stream and how many remembered requests named it, and forgets
        the hash when as many stores of it have been encoded (or when the table is past
        its bound, the least recently named first: a request that hit the cache never
        stores its blocks). A block whose request was forgotten goes out with no token
        ids (counted). Without token ids (``--kv-events-no-token-ids``) nothing is
        remembered and every ``token_ids`` is empty.
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
from inference_lab.serve import kv_wire
from inference_lab.serve.kv_replay import END_SEQ, ReplayBuffer, ReplayService

__all__ = [
    "BUFFER_STEPS",
    "END_SEQ",
    "HWM",
    "QUEUE_SIZE",
    "KVEventsSettings",
    "KVEventsHub",
    "ModelPublisher",
    "PublisherStatistics",
    "check_endpoint",
    "exposure_warnings",
    "offset_endpoint",
]

#: Batches kept for replay (vLLM's ``buffer_steps`` default).
BUFFER_STEPS = 10_000
#: Batches waiting for the publisher thread; past this the oldest is dropped (Rule 4).
QUEUE_SIZE = 100_000
#: The PUB socket's high-water mark: messages queued for one subscriber before ZeroMQ
#: drops its new ones (a subscriber further behind than the replay buffer cannot be made
#: whole from it anyway; vLLM's default is 100,000).
HWM = BUFFER_STEPS
#: How long the publisher thread sleeps between looks at the replay socket (seconds).
REPLAY_POLL = 0.02
#: Replay messages (requests taken, batches and end markers sent) per second (kv_replay
#: Rule 3): a full replay of the buffer takes half a second.
REPLAY_RATE = 20_000.0
#: Replay messages between two drains of the live queue.
REPLAY_SLICE = 256
#: Replay requests answered at once (round robin); the rest wait in ZeroMQ's queues.
REPLAY_PENDING = 16
#: Hashes remembered per model for token ids (Rule 5), at least this many.
MIN_REMEMBERED = 1 << 16
#: Admissions waiting for the publisher thread to remember them; past this the oldest is
#: forgotten (Rule 5).
REMEMBER_QUEUE = 1 << 16
_ENDPOINT = re.compile(r"(tcp://(\*|\[[^\]]+\]|[^:/\s]+):(\*|\d{1,5})|(ipc|inproc)://\S+)")


@attrs.frozen(kw_only=True)
class KVEventsSettings:
    """``--kv-events-endpoint``, ``--kv-events-replay-endpoint``, ``--kv-events-topic``,
    ``--kv-events-no-token-ids`` (``token_ids`` False)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    token_ids: bool = True


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
    """The ``k``-th model's endpoint (Rule 1); a TCP port ``*`` or 0 (any free port) is
    left as it is, as vLLM leaves port 0."""
    if k == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return endpoint if port == "*" or int(port) == 0 else f"{head}:{int(port) + k}"
    return f"{endpoint}_{k}"


def binds(endpoint: str) -> bool:
    """vLLM's rule (Rule 1): bind a wildcard, ``::``, ``ipc://`` or ``inproc://``."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def exposure_warnings(settings: KVEventsSettings | None) -> list[str]:
    """One start-up warning per KV-event endpoint the server would bind on an address
    other machines may reach (``kv_wire.exposed_endpoints``); none without KV events.
    For ``settings.startup_warnings``."""
    if settings is None:
        return []
    exposed = kv_wire.exposed_endpoints(
        settings.endpoint, settings.replay_endpoint, binds(settings.endpoint)
    )
    what = "block hashes" if not settings.token_ids else "token ids (the prompts' text)"
    return [
        f"KV events bound on {value}: every client that reaches it can read the {what} of "
        "every cached prompt; bind 127.0.0.1 or put it behind a network policy "
        "(docs/security.md)"
        for value in exposed
    ]


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
    #: Replay requests taken off the socket, answers sent whole, answers cut short (the
    #: requester gone or not reading), batches replayed.
    replay_requests: int
    replays: int
    replays_abandoned: int
    replayed: int


@attrs.frozen(kw_only=True)
class ReplayLimits:
    """How the replay socket is served (:mod:`inference_lab.serve.kv_replay` Rule 3)."""

    rate: float = REPLAY_RATE
    slice_: int = REPLAY_SLICE
    pending: int = REPLAY_PENDING


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
        token_ids: bool = True,
        queue_size: int = QUEUE_SIZE,
        buffer_steps: int = BUFFER_STEPS,
        hwm: int = HWM,
        replay_limits: ReplayLimits = ReplayLimits(),  # noqa: B008 - frozen
    ) -> None:
        zmq, msgspec = _modules()
        self._zmq = zmq
        self._encoder = msgspec.msgpack.Encoder()
        self.model = deployment.model.name
        self.block_size = deployment.scheduler.block_size
        self._kind = kv_wire.spec_kind(deployment)
        self.token_ids = token_ids
        self.topic = topic.replace("{model}", self.model).encode("utf-8")
        self._queue: collections.deque[tuple[int, float, int, tuple[KVEvent, ...]]] = (
            collections.deque()
        )
        self._queue_size = queue_size
        self._buffer = ReplayBuffer(buffer_steps)
        cap = max(MIN_REMEMBERED, 2 * deployment.total_blocks * deployment.workers)
        #: hash -> [stream, block index, requests that named it] (the publisher thread's)
        self._remembered: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()
        self._remember_cap = cap
        #: Admissions not yet applied to the table (appended by trio's thread, Rule 5).
        self._admitted: collections.deque[tuple[Sequence[int], Any]] = collections.deque(
            maxlen=REMEMBER_QUEUE
        )
        self._seq = 0
        self._sent = 0
        self._dropped = 0
        self._missing = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._pub, self._replay = self._sockets(ctx, endpoint, replay_endpoint, hwm, buffer_steps)
        self._replayer = (
            ReplayService(
                self._replay,
                zmq,
                self.topic,
                self._buffer,
                rate=replay_limits.rate,
                slice_=replay_limits.slice_,
                pending=replay_limits.pending,
            )
            if self._replay is not None
            else None
        )

    def _sockets(
        self, ctx: Any, endpoint: str, replay_endpoint: str | None, hwm: int, buffer_steps: int
    ) -> tuple[Any, Any]:
        """The PUB socket (bound or connected, Rule 1) and the ROUTER (or None); sets
        ``endpoint``, ``replay_endpoint`` and ``bound``. ConfigError naming the model and
        the endpoint when one cannot be used."""
        zmq = self._zmq
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(hwm)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        try:
            self.bound = binds(endpoint)
            if self.bound:
                pub.bind(endpoint)
                self.endpoint: str = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # kv_replay Rule 4
                replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # one whole replay
                replay.bind(replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            where = replay_endpoint if replay is not None else endpoint
            raise ConfigError(f"KV events of {self.model}: cannot use {where}: {exc}") from None
        return pub, replay

    # -- the serving side (trio's thread) ------------------------------------------------
    def remember(self, hashes: Sequence[int], tokens: Any) -> None:
        """The stream ``tokens`` (ids, numpy) a request was hashed with, its chain
        ``hashes`` (Rule 5): queued for the publisher thread, which owns the table.
        Called at admission, before the engine can store the request's blocks; nothing
        is kept without token ids."""
        if self.token_ids:
            self._admitted.append((hashes, tokens))

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
        replay = self._replayer.statistics() if self._replayer is not None else None
        return PublisherStatistics(
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            batches=self._seq,
            sent=self._sent,
            dropped=self._dropped,
            missing_tokens=self._missing,
            replay_requests=replay.requests if replay is not None else 0,
            replays=replay.answered if replay is not None else 0,
            replays_abandoned=replay.abandoned if replay is not None else 0,
            replayed=replay.replayed if replay is not None else 0,
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
        """Live batches first, whole; then one bounded replay turn; then wait for either
        (Rules 3 and 4)."""
        wake = self._wake
        while True:
            self._take_admitted()  # bounded even while nothing is stored
            self._drain()
            pause = REPLAY_POLL
            if self._replayer is not None:
                pause = min(pause, self._replayer.turn())
            if self._stopping and not self._queue:
                return
            if pause > 0:
                wake.wait(pause)
                wake.clear()

    def _take_admitted(self) -> None:
        """Apply the admissions queued so far to the table (Rule 5): every one that
        came before a batch was published is applied before that batch is encoded."""
        admitted = self._admitted
        table = self._remembered
        while admitted:
            hashes, tokens = admitted.popleft()
            for i, h in enumerate(hashes):
                entry = table.get(h)
                if entry is None:
                    table[h] = [tokens, i, 1]
                else:
                    entry[0], entry[1], entry[2] = tokens, i, entry[2] + 1
                    table.move_to_end(h)
        while len(table) > self._remember_cap:
            table.popitem(last=False)

    def _drain(self) -> None:
        zmq = self._zmq
        queue = self._queue
        while queue:
            try:
                seq, ts, worker, events = queue.popleft()
            except IndexError:
                return
            self._take_admitted()
            payload = self._encoder.encode(
                kv_wire.batch(ts, [self._event(e) for e in events], worker)
            )
            self._buffer.append(seq, payload)
            try:
                self._pub.send_multipart(
                    (self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                )
                self._sent += 1
            except zmq.Again:
                pass  # no peer ready (a connecting socket): replay still has it

    def _event(self, event: KVEvent) -> dict[str, Any]:
        if isinstance(event, BlockStored):
            if event.medium != kv_wire.MEDIUM_GPU:
                # a tier's store, as vLLM's offloading connector publishes it: no parent,
                # no tokens, block size 0
                return kv_wire.stored(event.block_hashes, None, [], 0, self._kind, event.medium)
            return kv_wire.stored(
                event.block_hashes,
                event.parent_block_hash,
                self._token_ids(event.block_hashes) if self.token_ids else [],
                self.block_size,
                self._kind,
            )
        if isinstance(event, BlockRemoved):
            return kv_wire.removed(event.block_hashes, event.medium)
        assert isinstance(event, AllBlocksCleared)
        return kv_wire.cleared()

    def _token_ids(self, hashes: Sequence[int]) -> list[int]:
        table = self._remembered
        bs = self.block_size
        found = []
        for h in hashes:
            entry = table.get(h)
            if entry is not None:
                found.append(entry)
                entry[2] -= 1  # one store of it encoded
                if entry[2] <= 0:
                    del table[h]
        if len(found) < len(hashes):
            self._missing += 1
            return []
        parts = [tokens[i * bs : (i + 1) * bs] for tokens, i, _ in found]
        ids: list[int] = np.concatenate(parts).tolist()
        return ids


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
                    token_ids=settings.token_ids,
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
            tokens = "" if p.token_ids else ", without token ids"
            lines.append(f"  KV events of {name}: {how} {p.endpoint}{replay}{tokens}")
        return lines
