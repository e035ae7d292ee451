"""The scheduler's two ways in (its Rule 5; the fast path's Rule 2) give the same events,
to the bit.

Each scenario runs the same operations (submissions, late arrivals, aborts at fixed
event counts) on three engines: one that never takes the fast path, one that takes
it at the default size and one that enters it for any batch of two or more requests, and
compares every ``StepEvents`` they return, and the KV block accounting along the way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from inference_lab.core.config import Deployment, EfficiencyOverride
from inference_lab.core.engine import Engine, RequestSpec, StepEvents
from inference_lab.core.engine import fast_path as fast_module
from tests.engine_util import (
    DEEPSEEK_V3,
    GPT_OSS_20B,
    LLAMA8B,
    ROOT,
    assert_blocks_conserved,
    deployment,
)


def _specs(
    count: int, seed: int, *, rate: float, groups: bool, hashes: bool, prompt_mu: float = 5.5
) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, count))
    prompts = np.maximum(rng.lognormal(prompt_mu, 0.8, count), 1).astype(int)
    outputs = np.maximum(rng.lognormal(3.5, 0.8, count), 1).astype(int)
    out = []
    for i in range(count):
        n = int(rng.integers(2, 4)) if groups and i % 7 == 3 else 1
        chain: tuple[int, ...] = ()
        if hashes and i % 3 == 0:
            chain = tuple(range(1000 * (i % 5), 1000 * (i % 5) + int(prompts[i]) // 16))
        target = int(outputs[i]) if i % 5 else max(1, int(outputs[i]) // 2)
        out.append(
            RequestSpec(
                prompt_tokens=int(prompts[i]),
                max_tokens=int(outputs[i]),
                target=target,
                arrival_time=float(times[i]),
                n=n,
                block_hashes=chain,
            )
        )
    return out


def _drive(
    dep: Deployment, specs: list[RequestSpec], vector_min: int, *, disturb: bool
) -> list[StepEvents]:
    """Run ``specs`` on a fresh engine whose fast path starts at ``vector_min``
    running requests; with ``disturb``, abort a running request every 97 events and hand
    over a late arrival (stamped before the step in flight) every 89."""
    saved = fast_module.FAST_PATH_MIN
    fast_module.FAST_PATH_MIN = vector_min
    try:
        eng = Engine(dep)
        ids = [eng.submit(s) for s in specs]
        events: list[StepEvents] = []
        count = 0
        while (t := eng.next_event_time()) is not None:
            events.append(eng.step())
            count += 1
            if disturb and count % 97 == 0:
                running = [r for w in eng.workers for r in w.running]
                if running:
                    eng.abort(running[len(running) // 2].id)
            if disturb and count % 89 == 0:
                late = RequestSpec(
                    prompt_tokens=40 + count % 50,
                    max_tokens=5 + count % 13,
                    arrival_time=max(0.0, eng.now - 1e-6),
                )
                ids.append(eng.submit(late))
            if count % 50 == 0:
                assert_blocks_conserved(eng)
            del t
        assert_blocks_conserved(eng)
        # plain Python ints, as the serving layer writes them out (not numpy scalars)
        assert {type(x) for ev in events for pair in ev.tokens for x in pair} <= {int}
        assert {type(f.output_tokens) for ev in events for f in ev.finished} <= {int}
        stats = eng.statistics()
        assert stats.kv_used_blocks == 0 and stats.running == 0
        return events
    finally:
        fast_module.FAST_PATH_MIN = saved


def _without_speculation(dep: Deployment) -> Deployment:
    """``dep`` without its ``[speculative]`` table (which keeps the fast path off)."""
    return attrs.evolve(dep, speculative=None)


SCENARIOS: dict[str, Callable[[], tuple[Deployment, dict[str, Any]]]] = {
    "gpt-oss-loaded": lambda: (deployment(GPT_OSS_20B), {"rate": 400.0}),
    "preemptions": lambda: (deployment(LLAMA8B, blocks=300), {"rate": 200.0}),
    "no-chunked-prefill": lambda: (
        deployment(LLAMA8B, enable_chunked_prefill=False, max_num_batched_tokens=4096),
        {"rate": 300.0},
    ),
    "small-budget": lambda: (
        deployment(GPT_OSS_20B, max_num_batched_tokens=512, long_prefill_token_threshold=128),
        {"rate": 300.0},
    ),
    "groups": lambda: (deployment(LLAMA8B), {"rate": 300.0, "groups": True}),
    "prefix-cache": lambda: (deployment(LLAMA8B), {"rate": 300.0, "hashes": True}),
    "kv-aware-replicas": lambda: (
        deployment(LLAMA8B, replicas=2, router="kv_aware"),
        {"rate": 500.0},
    ),
    "sjf": lambda: (deployment(LLAMA8B, policy="sjf", blocks=400), {"rate": 300.0}),
    # short prompts: decoding contexts cross the 128-position window, blocks grow often
    "gpt-oss-window-crossing": lambda: (
        deployment(GPT_OSS_20B, block_size=16),
        {"rate": 600.0, "prompt_mu": 3.8},
    ),
    # MLA layers (their terms take each row's positions) on lockstep dp-attention ranks
    "mla-dp-attention": lambda: (_without_speculation(deployment(DEEPSEEK_V3)), {"rate": 800.0}),
}


@pytest.mark.parametrize("disturb", [False, True], ids=["plain", "aborts-and-late-joins"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_vectorised_mode_gives_the_same_events(name: str, disturb: bool) -> None:
    """Every event (tokens, completions with their times, step prices and utilisations)
    is identical whether the engine never, sometimes or almost always steps over numpy
    columns; blocks are conserved throughout."""
    dep, options = SCENARIOS[name]()
    specs = _specs(
        400,
        seed=7,
        rate=options["rate"],
        groups=options.get("groups", False),
        hashes=options.get("hashes", False),
        prompt_mu=options.get("prompt_mu", 5.5),
    )
    reference = _drive(dep, specs, 1 << 30, disturb=disturb)
    assert sum(1 for ev in reference for _ in ev.finished) > 300
    for vector_min in (fast_module.FAST_PATH_MIN, 2):
        assert _drive(dep, specs, vector_min, disturb=disturb) == reference


def test_vectorised_mode_is_entered_under_load() -> None:
    """A loaded plain deployment does step in the fast path (so the comparison above
    compares two different paths)."""
    eng = Engine(deployment(GPT_OSS_20B))
    for s in _specs(400, seed=7, rate=400.0, groups=False, hashes=False):
        eng.submit(s)
    seen = 0
    while eng.next_event_time() is not None:
        eng.step()
        seen += eng.workers[0].vec is not None
    assert seen > 100


def test_a_preordered_arrival_comes_before_an_event_at_its_time() -> None:
    """Rule 11: an arrival submitted with ``preorder`` after the engine has filed a step
    end at its very time is handled before that step end, as if it had been submitted
    first (it joins the batch starting there); without it, it comes after."""
    orders = []
    for preorder in (None, 1):
        eng = Engine(deployment(LLAMA8B))
        eng.submit(RequestSpec(prompt_tokens=100, max_tokens=5), preorder=0)
        eng.step()  # the arrival
        eng.step()  # its prefill step starts at 0
        end = eng.next_event_time()
        assert end is not None and end > 0
        eng.submit(RequestSpec(prompt_tokens=50, max_tokens=5, arrival_time=end), preorder=preorder)
        first = eng.step()
        orders.append((first.time, bool(first.arrived), first.step is not None))
        if first.arrived:  # handled first: it joins the step that starts at `end`
            second = eng.step()
            assert second.step is not None and second.step.num_seqs == 2
    assert orders == [(end, False, True), (end, True, False)]


@pytest.mark.parametrize("config", [GPT_OSS_20B, LLAMA8B], ids=["windows", "full"])
def test_decode_terms_are_the_batch_terms_of_the_same_batch(config: Any) -> None:
    """`Roofline.decode_terms_of` (decoding sequences given by their count and window
    sums, then a few other sequences) gives exactly the integers `batch_terms` sums over
    the whole batch, around the window's edge too."""
    rf = Engine(deployment(config)).roofline
    windows = rf.window_classes()
    rng = np.random.default_rng(3)
    for size in (0, 1, 40, 300):
        c = rng.integers(0, 400, size).astype(np.int64)
        c[: min(size, 3)] = [126, 127, 128][: min(size, 3)]
        extra_n, extra_c = [1, 700, 33], [5, 0, 120]
        sums = [int(np.minimum(c, w - 1).sum()) if w > 0 else int(c.sum()) for w in windows]
        got = rf.decode_terms_of(size, sums, extra_n, extra_c)
        want = rf.batch_terms([1] * size + extra_n, c.tolist() + extra_c)
        assert (got.tokens, got.seqs, got.sums) == (want.tokens, want.seqs, want.sums)
        assert rf.price(got) == rf.price(want)


def test_the_lazy_decoding_rows_are_filed_and_summed_exactly() -> None:
    """`running_rows` Rule 4: after every event, each decoding row's lazy columns plus the
    decode counter are its request's true positions and tokens, it is filed to finish
    when its output reaches its target and to grow when its positions reach what its
    blocks hold, and the window sums the roofline is given are the sums over its rows --
    on a run whose contexts cross the 128-position window while decoding."""
    dep = deployment(GPT_OSS_20B, block_size=16)
    saved = fast_module.FAST_PATH_MIN
    fast_module.FAST_PATH_MIN = 2
    try:
        eng = Engine(dep)
        for s in _specs(400, seed=11, rate=600.0, groups=False, hashes=False, prompt_mu=3.8):
            eng.submit(s)
        checked = crossed = 0
        while eng.next_event_time() is not None:
            eng.step()
            w = eng.workers[0]
            vec = w.vec
            if vec is None or not vec.decoding:
                continue
            g, k = vec.g, vec.decoding
            rows = w.running[:k]
            comp = [r.lazy_base + g for r in rows]
            for r, c in zip(rows, comp, strict=True):
                assert r in vec.finish_cal[r.target_tokens - (c - r.prompt_tokens + 1 - g)]
                assert (r, r.lazy_base) in vec.grow_cal[max(r.block_room - r.lazy_base, g)]
                assert r.block_room == eng.roofline.room_for(r.num_blocks) or r.block_room <= c
                assert w.kv.blocks_for(c) <= r.num_blocks
            want = [
                sum(min(c, window - 1) if window else c for c in comp) for window in vec.windows
            ]
            assert vec.decode_sums() == want
            assert vec.decode_totals() == [[s + k, s + k] for s in want]
            checked += 1
            crossed += any(c < 127 for c in comp) and any(c >= 127 for c in comp)
        assert checked > 200 and crossed > 50
    finally:
        fast_module.FAST_PATH_MIN = saved


@pytest.mark.parametrize(
    "config", [GPT_OSS_20B, LLAMA8B, ROOT / "configs" / "Qwen3-30B-A3B.toml"], ids=str
)
def test_the_common_price_is_the_general_one_to_the_bit(config: Any) -> None:
    """`Roofline.price`'s body for the common case (no step table, MLA class or DP
    attention) gives exactly the `StepCost` of the general body, over batches from one
    decoding sequence to a full budget of prefill, with and without a step overhead,
    time_correction and tensor parallelism."""
    dep = deployment(config)
    variants = [
        dep,
        attrs.evolve(
            dep,
            hardware=attrs.evolve(
                dep.hardware,
                efficiency=EfficiencyOverride(flops=0.7, step_overhead=0.003),
                time_correction=attrs.evolve(dep.hardware.time_correction, alpha=1.1, beta=2e-4),
            ),
        ),
        attrs.evolve(  # with all-reduces
            dep,
            hardware=attrs.evolve(
                dep.hardware, tp=4, efficiency=EfficiencyOverride(step_overhead=0.0031)
            ),
        ),
    ]
    rng = np.random.default_rng(5)
    for d in variants:
        rf = Engine(d).roofline
        assert rf._plain
        for size in (1, 2, 37, 256):
            ns = rng.integers(1, 3, size).tolist()
            ns[0] = int(rng.integers(1, 4000))  # a prefill chunk
            cs = rng.integers(0, 9000, size).tolist()
            terms = rf.batch_terms(ns, cs)
            general = rf._price(terms.tokens, terms.seqs, terms.sums, terms.mla)
            assert rf.price(terms) == general
            assert rf.price(terms) == general  # the second time from the cache
        empty = rf.batch_terms([], [])
        assert rf.price(empty) == rf._price(0, 0, empty.sums, empty.mla)


def test_preordered_arrivals_in_any_order_are_handled_by_time_then_preorder() -> None:
    """Engine Rule 6: arrivals submitted with ``preorder`` are handled by (time, preorder),
    whatever order they were submitted in."""
    eng = Engine(deployment(LLAMA8B))
    times = [0.5, 0.25, 0.25, 0.75, 0.5]
    ids = {}
    for preorder in (4, 0, 1, 3, 2):  # not in order
        ids[preorder] = eng.submit(
            RequestSpec(prompt_tokens=10, max_tokens=2, arrival_time=times[preorder]),
            preorder=preorder,
        )
    order = []
    while eng.next_event_time() is not None:
        ev = eng.step()
        order += ev.arrived
    by_time = sorted(ids, key=lambda p: (times[p], p))
    assert order == [ids[p] for p in by_time]


@pytest.mark.parametrize("chunked", [True, False])
def test_admitting_a_plain_request_takes_its_first_chunk(chunked: bool) -> None:
    """`admit_head`'s own reckoning for a plain request without a prefix to look up is
    `first_chunk`'s: the same positions and blocks, refused in the same cases -- fresh
    and preempted requests (a re-prefill of ``prompt + output - 1``), prompts around the
    token budget and the long-prefill cap."""
    dep = deployment(
        GPT_OSS_20B,
        max_num_batched_tokens=2048,
        long_prefill_token_threshold=700,
        enable_chunked_prefill=chunked,
        max_num_seqs=1 << 20,
    )
    rng = np.random.default_rng(9)
    checked = refused = 0
    for _ in range(300):
        eng = Engine(dep)
        w = eng.workers[0]
        prompt = int(rng.integers(1, 3000 if chunked else 1990))
        eng.submit(RequestSpec(prompt_tokens=prompt, max_tokens=50))
        eng.step()  # its arrival: it waits
        r = w.waiting.peek()
        assert r is not None
        r.num_output = int(rng.choice([0, 1, 2, 30]))  # as if preempted after that many tokens
        budget = int(rng.integers(1, 2049))
        expected = w.first_chunk(r, budget)
        admitted = w.admit_head(0.0, 1, budget)
        if expected is None:
            assert admitted is None
            refused += 1
            continue
        assert admitted is not None
        assert admitted[1] == expected[1] and r.num_blocks == expected[2]
        checked += 1
    assert checked > 100 and (refused > 10 or chunked)


@pytest.mark.parametrize(
    "dep",
    [
        deployment(GPT_OSS_20B),
        deployment(GPT_OSS_20B, blocks=40),
        deployment(LLAMA8B, blocks=300),
        deployment(LLAMA8B, enable_chunked_prefill=False, max_num_batched_tokens=4096),
    ],
    ids=["gpt-oss", "gpt-oss-40-blocks", "llama-300-blocks", "no-chunked-prefill"],
)
def test_the_plain_fit_bound_is_check_fits(dep: Deployment) -> None:
    """`submit` skips `check_fits` for a plain request within the engine's bound on its
    total: a plain request fits exactly when its total is within that bound."""
    eng = Engine(dep)
    bound = eng._fits_total
    assert bound > 0
    for total in [*range(max(2, bound - 70), bound + 70), bound * 2]:
        for prompt in (1, total // 2, total - 1):
            fits = eng.check_fits(prompt, total - prompt) is None
            assert fits == (total <= bound), (total, prompt)
