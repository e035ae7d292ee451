"""A served model with a KV tier behind HBM (docs/kv-tiers.md), over real sockets: driven
by ``inference-lab load --sessions``, its KV events -- with ``medium`` "CPU" for
the blocks HBM evicted to the host tier -- decoded with the structs that mirror vLLM's
declarations, and its ``/metrics`` reporting what the tier held and gave back."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import attrs
import msgspec
import trio
import zmq
from prometheus_client.parser import text_string_to_metric_families

from inference_lab import cli
from inference_lab.core.config import load_deployment
from inference_lab.serve import ServeSettings, create_app, get_state
from inference_lab.serve.kv_events import KVEventsSettings
from inference_lab.serve.server import bind_socket, serve_app
from inference_lab.traffic.sessions import SessionRecord, Turn, write_sessions
from tests.conftest import CONFIG_FILES, GPT
from tests.serve_util import http_request, read_until_eof
from tests.test_serve_kv_events import DECODER, ENCODER, WireRemoved, WireStored, ordered

TOPIC = "kv@tiers@{model}"


def decode(payload: bytes) -> Any:
    """A batch decoded with vLLM's declarations, re-encoded to the same value."""
    batch = DECODER.decode(payload)
    assert ordered(msgspec.msgpack.decode(payload)) == ordered(
        msgspec.msgpack.decode(ENCODER.encode(batch))
    )
    return batch


async def test_a_host_tier_publishes_cpu_events_and_fetches_returning_turns(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Eight conversations of three turns with a 2,000-token system prompt each (not
    shared) on a KV cache of 60 blocks of 64: HBM evicts, the host tier keeps the blocks
    (BlockStored with medium "CPU"), the returning turns fetch them (offload counters in
    /metrics), and every answer is a 200."""
    dep = load_deployment(CONFIG_FILES[GPT], "b200")
    sched = attrs.evolve(
        dep.scheduler,
        kv_cache_capacity=60 * dep.block_bytes,
        kv_offloading_size=4.0,
    )
    dep = attrs.evolve(dep, scheduler=sched)
    settings = ServeSettings(
        deployments=(dep,),
        kv_events=KVEventsSettings(endpoint="tcp://127.0.0.1:*", topic=TOPIC),
    )
    app = create_app(settings)
    ctx = zmq.Context()
    try:
        with trio.fail_after(90):
            urls: list[str] = await nursery.start(serve_app, app, bind_socket("127.0.0.1", 0))
            state = get_state(app)
            publisher = state.kv_events.publishers[GPT]  # type: ignore[union-attr]
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(publisher.endpoint)
            await trio.sleep(0.2)  # (a SUB socket's subscription takes a moment to reach it)
            sessions = [
                SessionRecord(
                    session=i,
                    start=0.05 * i,
                    system_prompt_tokens=2000,
                    shared_system_prompt=False,
                    turns=(Turn(100, 20), Turn(50, 20, 0.3), Turn(50, 20, 0.3)),
                )
                for i in range(8)
            ]
            path = tmp_path / "s.jsonl"
            write_sessions(path, sessions)
            csv_path = tmp_path / "turns.csv"
            argv = ["load", "--url", urls[0], "--model", GPT, "--sessions", str(path)]
            code = await trio.to_thread.run_sync(cli.main, [*argv, "--csv", str(csv_path), "-q"])
            assert code == 0
            with csv_path.open() as fh:
                records = list(csv.DictReader(fh))
            assert [r["outcome"] for r in records] == ["ok"] * 24
            media: dict[str, int] = {}
            with trio.fail_after(20):
                while len(media) < 2 or sum(media.values()) < 4:
                    if not await trio.to_thread.run_sync(sub.poll, 200):
                        break
                    _, _, payload = sub.recv_multipart()
                    for event in decode(payload).events:
                        if isinstance(event, WireStored) and event.medium != "GPU":
                            # as vLLM's offloading connector stores: no parent, no tokens
                            assert event.parent_block_hash is None and event.token_ids == []
                            assert event.block_size == 0
                        if isinstance(event, (WireStored, WireRemoved)):
                            key = f"{type(event).__name__}:{event.medium}"
                            media[key] = media.get(key, 0) + 1
            assert media.get("WireStored:CPU", 0) > 0 and media.get("WireRemoved:GPU", 0) > 0
            stats = state.runtimes[GPT].engine.statistics()
            assert stats.tiers is not None and stats.tiers.fetches > 0
            late = [int(r["cached_tokens"]) for r in records if int(r["turn"]) > 0]
            assert sum(late) > 60 * 64  # more than HBM holds at once
            port = int(urls[0].rsplit(":", 1)[1].split("/")[0])
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(http_request("GET", "/metrics", close=True))
                text = (await read_until_eof(stream)).decode()
            assert text.startswith("HTTP/1.1 200")
            body = text.split("\r\n\r\n", 1)[1]
            series = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(body)
                for sample in family.samples
            }
            engine0 = (("engine", "0"), ("model_name", GPT))
            tiers = stats.tiers
            hits = series["vllm:external_prefix_cache_hits_total", engine0]
            assert hits == tiers.host_hit_tokens + tiers.disk_hit_tokens > 0
            loaded = (
                "vllm:kv_offload_total_bytes_total",
                (*engine0, ("transfer_type", "CPU_to_GPU")),
            )
            assert series[loaded] == tiers.fetch_bytes > 0
            stored = (
                "vllm:kv_offload_total_bytes_total",
                (*engine0, ("transfer_type", "GPU_to_CPU")),
            )
            assert series[stored] == tiers.host_stores * dep.block_bytes > 0
            held = ("inference_lab:kv_tier_blocks", (*engine0, ("tier", "host")))
            assert series[held] == tiers.host_blocks > 0
    finally:
        ctx.destroy(linger=0)
