"""LoRA adapters in the engine (core/engine/lora.py): the batch's adapter limit (Rule 1),
the GPU slots' loads and their price (Rule 2), the kernels' price (Rule 3), the adapters'
own block hashes and KV events (Rule 4), the adapter set's API and the [lora] table."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from inference_lab.core.config import (
    LoraAdapter,
    LoraConfig,
    adapter_widths,
    load_deployment,
    with_lora,
)
from inference_lab.core.engine import BlockStored, Engine
from inference_lab.core.engine.lora import LORA_BYTES
from inference_lab.core.roofline import Roofline
from inference_lab.errors import ConfigError
from tests.engine_util import LLAMA8B, assert_blocks_conserved, deployment, finished, run, spec

#: Llama-3.1-8B: 32 layers of q (4096 -> 32 x 128), k and v (4096 -> 8 x 128), o (back)
LLAMA_WIDTHS = 32 * (4 * 4096 + 2 * 4096 + 2 * 1024)


def lora_dep(max_loras: int = 2, adapters: int = 4, **kw: object) -> object:
    lora = LoraConfig(
        max_loras=max_loras,
        adapters=tuple(LoraAdapter(name=f"a{i}") for i in range(adapters)),
        **kw,  # type: ignore[arg-type]
    )
    return with_lora(deployment(), lora, "test")


def first_batch_ids(engine: Engine) -> list[int]:
    ev = engine.step()
    while ev.step is None:
        ev = engine.step()
    return sorted(r.id for r, _ in engine.workers[0].batch)


def test_adapter_widths_are_the_attention_projections_of_every_layer() -> None:
    dep = deployment()
    assert adapter_widths(dep.model, 0) == LLAMA_WIDTHS
    # with the MLP: gate and up (hidden -> I) and down (I -> hidden) on each of 32 layers
    assert adapter_widths(dep.model, 14336) == LLAMA_WIDTHS + 32 * 3 * (4096 + 14336)


def test_a_batch_holds_at_most_max_loras_adapters_and_skipped_requests_keep_their_place() -> None:
    e = Engine(lora_dep(max_loras=2))  # type: ignore[arg-type]
    ids = [e.submit(spec(64, 4, lora=f"a{i}")) for i in range(4)]
    base = e.submit(spec(64, 4))  # the base model is never skipped
    again = e.submit(spec(64, 4, lora="a0"))  # an adapter in the batch: admitted
    assert first_batch_ids(e) == sorted([ids[0], ids[1], base, again])
    w = e.workers[0]
    assert [r.id for r in w.waiting.in_order()] == [ids[2], ids[3]]  # in order
    assert w.lora is not None and w.lora.skips == 2
    events = run(e)
    for ev in events:
        if ev.step is not None:
            adapters = {r.lora for r, _ in w.batch if r.lora}
            assert len(adapters) <= 2
    done = finished(events)
    assert done[ids[2]].first_scheduled_time >= done[ids[0]].finish_time
    assert_blocks_conserved(e)


def test_max_loras_counts_the_running_requests_adapters() -> None:
    """A running request's adapter counts even in a step that cannot schedule it (no
    chunked prefill: a long prefill waits for the budget)."""
    dep = lora_dep(max_loras=1)
    dep = attrs.evolve(
        dep,
        scheduler=attrs.evolve(  # type: ignore[attr-defined]
            dep.scheduler,  # type: ignore[attr-defined]
            enable_chunked_prefill=False,
            max_num_batched_tokens=512,
        ),
    )
    e = Engine(dep)  # type: ignore[arg-type]
    e.submit(spec(100, 50, lora="a0"))
    e.submit(spec(400, 50, lora="a0"))
    e.submit(spec(60, 50, lora="a1"))
    for _ in range(400):
        if e.next_event_time() is None:
            break
        e.step()
        running = {r.lora for r in e.workers[0].running if r.lora}
        assert len(running) <= 1


def test_an_adapter_not_resident_is_loaded_over_the_host_link_and_priced() -> None:
    dep = lora_dep(max_loras=2)
    rf = Roofline(deployment())
    e = Engine(dep)  # type: ignore[arg-type]
    e.submit(spec(100, 3, lora="a0"))
    e.submit(spec(100, 3, lora="a1"))
    ev = e.step()
    while ev.step is None:
        ev = e.step()
    host = deployment().profile.host
    assert host is not None
    load = host.latency + 16 * LLAMA_WIDTHS * LORA_BYTES / host.bandwidth
    # kernels: 200 tokens through shrink and expand at rank 16; two adapters read once
    profile = deployment().profile
    rate = profile.flops("bf16")
    assert rate is not None
    flops = 2.0 * 200 * 16 * LLAMA_WIDTHS
    nbytes = 2 * 16 * LLAMA_WIDTHS * LORA_BYTES
    kernels = max(flops / rate, nbytes / rf.bandwidth)
    base = rf.price(rf.batch_terms([100, 100], [0, 0])).seconds
    assert ev.step.duration == pytest.approx(base + 2 * load + kernels, rel=1e-12)
    stats = e.statistics().workers[0].lora
    assert stats is not None
    assert stats.loads == 2 and stats.resident == ("a0", "a1")
    assert stats.load_seconds == pytest.approx(2 * load)
    # the next step: both resident, no load; a decode of 2 tokens
    ev = e.step()
    while ev.step is None:
        ev = e.step()
    decode = rf.price(rf.batch_terms([1, 1], [100, 100])).seconds
    kernels = max(2.0 * 2 * 16 * LLAMA_WIDTHS / rate, nbytes / rf.bandwidth)
    assert ev.step.duration == pytest.approx(decode + kernels, rel=1e-12)


def test_slots_evict_the_least_recently_used_adapter_not_in_the_batch() -> None:
    e = Engine(lora_dep(max_loras=2, max_cpu_loras=4))  # type: ignore[arg-type]
    run_one = lambda name: (e.submit(spec(32, 1, lora=name)), run(e))  # noqa: E731
    run_one("a0")
    run_one("a1")
    run_one("a0")  # a0 used last: a1 is the least recently used
    run_one("a2")
    w = e.workers[0]
    assert w.lora is not None
    stats = w.lora.statistics(w.running, w.waiting)
    assert stats.resident == ("a0", "a2")
    assert stats.loads == 3 and stats.cold_loads == 0
    run_one("a1")  # evicts a0 now
    assert w.lora.statistics(w.running, w.waiting).resident == ("a2", "a1")


def test_a_host_cache_miss_counts_cold() -> None:
    e = Engine(lora_dep(max_loras=1, max_cpu_loras=2, adapters=3))  # type: ignore[arg-type]
    for name in ("a1", "a2", "a0", "a2"):
        e.submit(spec(32, 1, lora=name))
        run(e)
    stats = e.statistics().workers[0].lora
    assert stats is not None
    # one GPU slot: every use loads; the host cache holds 2 (a1 and a2 of the config's
    # three): only a0 is read again, and it pushes a1 out, not a2 (used since)
    assert (stats.loads, stats.cold_loads) == (4, 1)


def test_prefixes_never_hit_across_adapters_and_events_name_the_adapter() -> None:
    dep = lora_dep(max_loras=4)
    e = Engine(dep, record_kv_events=True)  # type: ignore[arg-type]
    chain = tuple(range(100, 110))
    prompt = 10 * dep.scheduler.block_size  # type: ignore[attr-defined]
    for name in ("a0", None, "a1", "a0"):
        e.submit(spec(prompt, 2, lora=name, block_hashes=chain))
        run(e)
    w = e.statistics().workers[0]
    # the second a0 request found its 9 blocks (P - 1 positions), none of the others did
    assert w.prefix_cache_hits == 9 * dep.scheduler.block_size  # type: ignore[attr-defined]
    stored = [ev for ev in e.take_kv_events() if isinstance(ev, BlockStored)]
    assert [(s.lora_id, s.lora_name) for s in stored] == [(1, "a0"), (None, None), (2, "a1")]
    assert stored[1].block_hashes == chain
    assert len({s.block_hashes[0] for s in stored}) == 3


def test_unknown_adapters_load_and_unload() -> None:
    e = Engine(lora_dep(adapters=1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'zz'"):
        e.submit(spec(10, 2, lora="zz"))
    with pytest.raises(ValueError, match="already been loaded"):
        e.load_adapter("a0", "/x")
    with pytest.raises(ValueError, match="greater than max_lora_rank"):
        e.load_adapter("big", "/x", rank=32)
    added = e.load_adapter("new", "/adapters/new", rank=8)
    assert (added.id, added.rank, added.path) == (2, 8, "/adapters/new")
    rid = e.submit(spec(10, 5, lora="new"))
    e.step()
    e.step()
    e.unload_adapter("new")  # in use: it runs on, as vLLM lets it
    assert e.adapters is not None and "new" not in e.adapters.by_name
    late = e.submit(spec(10, 2, lora="new"))  # admitted before the unload, submitted after
    with pytest.raises(KeyError):
        e.unload_adapter("new")
    done = finished(run(e))
    assert rid in done and late in done
    plain = Engine(deployment())
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        plain.submit(spec(10, 2, lora="a0"))
    with pytest.raises(ValueError, match="not enabled"):
        plain.load_adapter("a0", "/x")


def test_a_late_arrival_joins_when_its_adapter_is_resident() -> None:
    """Engine Rule 2's late hand-over takes a base-model request, or one whose adapter keeps
    the batch within max_loras (loaded now if it is not in a slot), into the step in
    flight, priced as if it had been there from the start; one past max_loras waits for
    the next boundary."""
    for name, joins in (("a2", False), ("a1", True), ("a0", True), (None, True)):
        e = Engine(lora_dep(max_loras=2))  # type: ignore[arg-type]
        e.submit(spec(64, 10, lora="a0"))
        if name == "a2":  # a0 and a1 run: a2 would be a third adapter
            e.submit(spec(64, 10, lora="a1"))
        while e.workers[0].step_start == 0.0 and not e.workers[0].batch:
            e.step()  # the arrivals, then the first step starts, loading a0 (and a1)
        start = e.workers[0].step_start
        end = e.workers[0].step_end
        late = e.submit(spec(48, 10, lora=name, arrival_time=start - 1e-6))
        e.step()  # the late arrival
        assert (late in [r.id for r, _ in e.workers[0].batch]) is joins
        if not joins:
            assert e.workers[0].step_end == end
            continue
        on_time = Engine(lora_dep(max_loras=2))  # type: ignore[arg-type]
        on_time.submit(spec(64, 10, lora="a0"))
        on_time.submit(spec(48, 10, lora=name))
        first_batch_ids(on_time)
        assert e.workers[0].step_end == pytest.approx(
            start + (on_time.workers[0].step_end - on_time.workers[0].step_start), rel=1e-12
        )


def write_config(tmp_path: Path, lora: str) -> Path:
    text = LLAMA8B.read_text()
    path = tmp_path / "m.toml"
    path.write_text(text + "\n[lora]\n" + lora)
    return path


def test_the_lora_table_loads_and_bad_values_are_one_line_errors(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        'max_loras = 2\nmax_lora_rank = 32\nadapters = [{name = "sql", rank = 8}]\n',
    )
    dep = load_deployment(path, "b200")
    assert dep.lora is not None and dep.lora.adapters[0].rank == 8
    for bad, message in (
        ("max_lora_rank = 7\n", "lora.max_lora_rank: must be one of 1, 8, 16"),
        ("max_loras = 4\nmax_cpu_loras = 2\n", "lora.max_cpu_loras: must be >= max_loras"),
        ('adapters = [{name = "a", rank = 64}]\n', "lora.adapters.0.rank: must be <="),
        ('adapters = [{name = "a"}, {name = "a"}]\n', "named twice"),
        ("max_loras = 0\n", "lora.max_loras: must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=message) as info:
            load_deployment(write_config(tmp_path, bad), "b200")
        assert "\n" not in str(info.value)


def test_lora_is_refused_where_it_is_not_modelled() -> None:
    dep = deployment(kv_offloading_size=16.0)
    with pytest.raises(ConfigError, match="KV tiers"):
        with_lora(dep, LoraConfig(), "x")
