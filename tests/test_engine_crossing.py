"""A decode run's whole steps and the arrivals it crosses (fast path Rules 4 and 5, the
runs' Rule 3) are ``step()`` one event at a time, to the bit.

A decode run of a lone worker takes the steps that are not pure decode ones itself when
the fast path takes them whole (an admission, a prefill chunk) and, when a step ends past
the run's limit and only arrivals are due before it, handles those arrivals and goes on
without filing the boundary. Each case drives two engines through the same random
workload: one event by event with ``step()``, the other in ``run_until`` calls to random
cutoffs with no stop flag (so the runs may cross), with aborts and late submissions
between cutoffs, and compares every step's figures, every completion, the statistics and
the count of events.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace
from typing import Any

import attrs
import pytest

from inference_lab.core.config import Deployment, load_deployment
from inference_lab.core.engine import Engine, Finished, RequestSpec, stepping
from inference_lab.core.engine import decode_runs as runs_half
from inference_lab.core.engine import fast_path as fast_half
from inference_lab.core.engine import runs as runs_module
from inference_lab.core.engine.request import RUNNING
from inference_lab.core.engine.running_rows import RunningRows
from inference_lab.sim.records import StepTotals
from tests.engine_util import GPT_OSS_20B, LLAMA8B, ROOT, deployment
from tests.test_engine_runs import EAGLE, _cutoffs, _disturb, _same, _specs

DEEPSEEK_R1 = ROOT / "configs" / "frontier" / "DeepSeek-R1.toml"

#: single-worker workloads (crossing needs one worker): light and loaded decode runs (MLA too), the
#: fast path left inside a run (groups, prefix hits), late joins (the frontend latency),
#: preemption, chunked prefills as the run's whole steps, speculative decoding
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "light": (lambda: deployment(GPT_OSS_20B), {"rate": 60.0, "prompt_mu": 6.9, "output_mu": 5.3}),
    "loaded": (lambda: deployment(GPT_OSS_20B), {"rate": 250.0}),
    "groups": (lambda: deployment(GPT_OSS_20B), {"rate": 90.0, "groups": True}),
    "prefix-hits": (lambda: deployment(LLAMA8B), {"rate": 90.0, "hashes": True}),
    "frontend-latency": (
        lambda: deployment(GPT_OSS_20B, frontend_latency=0.003),
        {"rate": 120.0},
    ),
    "preemptions": (
        lambda: deployment(GPT_OSS_20B, blocks=500),
        {"rate": 60.0, "prompt_mu": 6.9, "output_mu": 5.3},
    ),
    "chunked": (
        lambda: deployment(
            GPT_OSS_20B, max_num_batched_tokens=384, long_prefill_token_threshold=96
        ),
        {"rate": 100.0},
    ),
    "speculative": (lambda: load_deployment(EAGLE, "h100"), {"rate": 60.0}),
    # MLA classes: the terms the roofline sums itself (a lone worker: tp 8, no DP ranks)
    "mla": (lambda: load_deployment(DEEPSEEK_R1, "h200"), {"rate": 60.0}),
}


def _drive(
    dep: Deployment, specs: list[RequestSpec], seed: int, runs: bool
) -> tuple[StepTotals, list[Finished], Any, float, int]:
    """As ``test_engine_runs._drive`` without stop flags, counting the events handled."""
    eng = Engine(dep)
    ids = [
        eng.submit(s) for s in specs if eng.check_fits(s.prompt_tokens, s.max_tokens, s.n) is None
    ]
    totals = StepTotals(speculative=dep.speculative is not None)
    finished: list[Finished] = []
    rnd = random.Random(seed)
    done: set[int] = set()
    events = 0
    for cutoff in _cutoffs(seed, specs[-1].arrival_time + 5.0):
        while (t := eng.next_event_time()) is not None and t < cutoff:
            if runs:
                events += eng.run_until(cutoff, totals, finished).events
                continue
            ev = eng.step()
            events += 1
            if ev.step is not None:
                totals.add(ev.step)
            finished.extend(ev.finished)
        done.update(f.request_id for f in finished)
        if eng.next_event_time() is None and cutoff != math.inf:
            continue
        _disturb(eng, ids, rnd, done)
    return totals, finished, eng.statistics(), eng.now, events


def _both_ways(name: str, seed: int) -> tuple[list[RequestSpec], Any]:
    """Case ``name``'s 300 requests driven both ways (seed ``seed``): the same steps,
    completions, state and count of events. Returns the specs and the stepped result."""
    make, kw = CASES[name]
    dep = make()
    specs = _specs(300, seed, **kw)
    stepped = _drive(dep, specs, seed, runs=False)
    ran = _drive(dep, specs, seed, runs=True)
    _same(stepped[:4], ran[:4])  # type: ignore[arg-type]
    assert stepped[4] == ran[4]
    return specs, stepped


@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_that_cross_arrivals_are_step_by_step(name: str, seed: int) -> None:
    """Every case, three seeds: the same steps, completions, state and event count."""
    _, stepped = _both_ways(name, seed)
    assert len(stepped[1]) > 100


def test_runs_do_cross_arrivals_and_admit(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 60 requests/s a lone worker's runs cross most arrivals and admit them in the
    run (so the comparison above covers both)."""
    crossed: list[float | None] = []
    whole: list[float | None] = []
    cross = runs_module.RunLoop._cross
    start_whole = runs_half.DecodeRuns._start_whole

    def counting_cross(self: Any, end: float) -> float | None:
        later = cross(self, end)
        crossed.append(later)
        return later

    def counting_whole(self: Any, *args: Any) -> float | None:
        duration = start_whole(self, *args)
        whole.append(duration)
        return duration

    monkeypatch.setattr(runs_module.RunLoop, "_cross", counting_cross)
    monkeypatch.setattr(runs_half.DecodeRuns, "_start_whole", counting_whole)
    lean = _count_admitting(monkeypatch)
    make, kw = CASES["light"]
    eng = Engine(make())
    specs = _specs(600, 3, **kw)
    for s in specs:
        eng.submit(s)
    report = eng.run_until(math.inf, StepTotals(), [])
    assert report.arrivals == len(specs)
    assert sum(1 for t in crossed if t is not None) > len(specs) // 2
    assert sum(1 for d in whole if d is not None) + lean["lean"] > len(specs) // 2


@pytest.mark.parametrize("seed", [21, 22])
@pytest.mark.parametrize("name", ["light", "loaded", "frontend-latency"])
def test_arrivals_a_run_crosses_are_inline(
    monkeypatch: pytest.MonkeyPatch, name: str, seed: int
) -> None:
    """The runs' Rule 3: the arrivals a run crosses are ``_arrive``'s for a lone worker,
    inline (none goes through ``_arrive`` itself there) -- compared with ``step()`` one
    event at a time."""
    seen: Counter[str] = Counter()
    cross = runs_module.RunLoop._cross
    arrive = stepping.EventLoop._arrive

    def counting_cross(self: Any, end: float) -> float | None:
        seen["crossing"] += 1
        arrivals = self._crossing[0].arrivals
        try:
            return cross(self, end)
        finally:
            seen["crossing"] -= 1
            seen["crossed"] += self._crossing[0].arrivals - arrivals

    def counting_arrive(self: Any, *args: Any) -> None:
        seen["arrive-in-cross" if seen["crossing"] else "arrive"] += 1
        arrive(self, *args)

    monkeypatch.setattr(runs_module.RunLoop, "_cross", counting_cross)
    monkeypatch.setattr(stepping.EventLoop, "_arrive", counting_arrive)
    specs, _ = _both_ways(name, seed)
    assert seen["crossed"] > len(specs) // 2, seen
    assert seen["arrive-in-cross"] == 0, seen


def _count_admitting(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the decode runs' admissions by ``_start_admitting`` (decode_runs Rule 4):
    those it started itself (``lean``) and those it handed to ``_start_whole``."""
    seen: Counter[str] = Counter()
    admitting = runs_half.DecodeRuns._start_admitting
    start_whole = runs_half.DecodeRuns._start_whole
    into_whole = fast_half.FastPath._admit_into_whole

    def counting(self: Any, *args: Any) -> float | None:
        before, general, waiting = seen["whole"], seen["general"], self.waiting.count
        duration = admitting(self, *args)
        lean = seen["whole"] == before
        seen["lean" if lean else "handed"] += 1
        seen["several"] += lean and waiting - self.waiting.count > 1  # (admitted)
        seen["continued"] += lean and seen["general"] > general  # (a head not plain)
        return duration

    def counting_whole(self: Any, *args: Any) -> float | None:
        seen["whole"] += 1
        return start_whole(self, *args)

    def counting_into(self: Any, *args: Any) -> Any:
        seen["general"] += 1
        return into_whole(self, *args)

    monkeypatch.setattr(runs_half.DecodeRuns, "_start_admitting", counting)
    monkeypatch.setattr(runs_half.DecodeRuns, "_start_whole", counting_whole)
    monkeypatch.setattr(fast_half.FastPath, "_admit_into_whole", counting_into)
    return seen


#: workloads where a run's admissions take the lean path and where they hand over: a
#: small budget with and without chunking, a cap, blocks short and readmitted preempted
#: requests, a policy's heap, prefix hits (light, and loaded: a prefix head after plain
#: ones admitted)
ADMITTING: dict[str, tuple[Any, dict[str, Any]]] = {
    "light": CASES["light"],
    "loaded": CASES["loaded"],
    "small-budget": (
        lambda: deployment(GPT_OSS_20B, max_num_batched_tokens=1024),
        {"rate": 90.0, "prompt_mu": 6.9, "output_mu": 5.3},
    ),
    "no-chunking": (
        lambda: deployment(GPT_OSS_20B, max_num_batched_tokens=1024, enable_chunked_prefill=False),
        {"rate": 90.0, "prompt_mu": 6.5, "output_mu": 5.3},
    ),
    "cap": (lambda: deployment(GPT_OSS_20B, max_num_seqs=12), {"rate": 90.0}),
    "sjf": (lambda: deployment(GPT_OSS_20B, policy="sjf"), {"rate": 150.0}),
    "preemptions": CASES["preemptions"],
    "prefix-hits": CASES["prefix-hits"],
    "prefix-loaded": (lambda: deployment(LLAMA8B), {"rate": 300.0, "hashes": True}),
}


@pytest.mark.parametrize("seed", [21, 22])
@pytest.mark.parametrize("name", sorted(ADMITTING))
def test_admissions_a_run_starts_are_step_by_step(
    monkeypatch: pytest.MonkeyPatch, name: str, seed: int
) -> None:
    """decode_runs Rule 4: each workload through runs free to cross arrivals and one
    ``step()`` at a time: the same steps, completions, state and event count; the lean
    admission was taken (on the light workload, most of the time; several heads at once
    when loaded), handed over where the cap or the blocks stop it, and went on by the
    general loop at a head with a prefix."""
    seen = _count_admitting(monkeypatch)
    make, kw = ADMITTING[name]
    dep = make()
    specs = _specs(300, seed, **kw)
    stepped = _drive(dep, specs, seed, runs=False)
    assert seen["lean"] + seen["handed"] == 0  # (step() starts no run)
    ran = _drive(dep, specs, seed, runs=True)
    _same(stepped[:4], ran[:4])  # type: ignore[arg-type]
    assert stepped[4] == ran[4]
    assert seen["lean"] > 0, seen
    if name == "light":
        assert seen["lean"] > seen["handed"], seen
    if name in ("cap", "preemptions"):  # (the cap, blocks short: handed over)
        assert seen["handed"] > 0, seen
    if name == "loaded":  # (several heads admitted in one step)
        assert seen["several"] > 0, seen
    if name == "prefix-loaded":  # (a head with a prefix after plain ones: the loop's)
        assert seen["continued"] > 0, seen


#: workloads whose admission steps end in a run in each way decode_runs Rule 5 takes: the
#: new row decodes (light, loaded), it was a prefill chunk (a small budget, chunked
#: prefills), a preempted request's prefill again (preemptions), it finished at its first
#: token (one-token outputs); decoding rows finishing at the same end, and at the end of
#: a pure step the run did not take in a stretch (loaded, one-token)
ENDS: dict[str, tuple[Any, dict[str, Any]]] = {
    "light": CASES["light"],
    "loaded": CASES["loaded"],
    "small-budget": ADMITTING["small-budget"],
    "chunked": CASES["chunked"],
    "preemptions": CASES["preemptions"],
    "one-token": (lambda: deployment(GPT_OSS_20B), {"rate": 90.0}),  # (every 4th: one)
}


def _count_ends(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the ways decode_runs Rule 5's inline ends take (``_end_admission``'s, a
    pure step's end with finishes in ``_end_in_run``, and ``FastPath.end_rest_rows``'
    with several rest rows)."""
    seen: Counter[str] = Counter()
    end_admission = runs_half.DecodeRuns._end_admission
    end_in_run = runs_half.DecodeRuns._end_in_run

    def counting(self: Any, vec: Any, *args: Any) -> bool:
        r = self.running[vec.decoding]
        out, decoding = r.num_output, vec.decoding
        finishing = len(vec.finish_cal.get(vec.g + 1, ()))
        if finishing:
            seen["with-finishes"] += 1
        ended = end_admission(self, vec, *args)
        if r.status != RUNNING:
            seen["finished"] += 1
        elif vec.decoding > decoding - finishing:
            seen["decodes"] += 1
        else:
            seen["again" if out else "chunk"] += 1
        return ended

    def counting_pure(self: Any, vec: Any, *args: Any) -> bool:
        if vec.size == vec.decoding and vec.g + 1 in vec.finish_cal:
            seen["pure-finishes"] += 1
        return end_in_run(self, vec, *args)

    def counting_rest(self: Any, vec: Any, *args: Any) -> bool:
        seen["several"] += 1
        if vec.g + 1 in vec.finish_cal:
            seen["several-with-finishes"] += 1
        rest = [r for r in self.running[vec.decoding : vec.size] if r.status == RUNNING]
        ended = end_rest_rows(self, vec, *args)
        if any(r.status != RUNNING for r in rest):
            seen["several-finished"] += 1
        return ended

    end_rest_rows = fast_half.FastPath.end_rest_rows
    monkeypatch.setattr(runs_half.DecodeRuns, "_end_admission", counting)
    monkeypatch.setattr(runs_half.DecodeRuns, "_end_in_run", counting_pure)
    monkeypatch.setattr(fast_half.FastPath, "end_rest_rows", counting_rest)
    return seen


@pytest.mark.parametrize("seed", [31, 32])
@pytest.mark.parametrize("name", sorted(ENDS))
def test_ends_of_admission_steps_are_step_by_step(
    monkeypatch: pytest.MonkeyPatch, name: str, seed: int
) -> None:
    """decode_runs Rule 5: each workload through runs free to cross arrivals and one
    ``step()`` at a time: the same steps, completions, state and event count, with the
    ends of admission steps taken inline (one rest row and several), each way the
    workload gives."""
    seen = _count_ends(monkeypatch)
    make, kw = ENDS[name]
    dep = make()
    specs = _specs(300, seed, **kw)
    if name == "one-token":
        specs = [attrs.evolve(s, target=1) if i % 4 == 0 else s for i, s in enumerate(specs)]
    stepped = _drive(dep, specs, seed, runs=False)
    assert not seen  # (step() starts no run)
    ran = _drive(dep, specs, seed, runs=True)
    _same(stepped[:4], ran[:4])  # type: ignore[arg-type]
    assert stepped[4] == ran[4]
    assert seen["decodes"] > 0, seen
    assert seen["several"] > 0, seen
    if name in ("small-budget", "chunked"):
        assert seen["chunk"] > 0, seen
    if name == "preemptions":
        assert seen["again"] > 0, seen
    if name == "one-token":
        assert seen["finished"] > 0, seen
    if name in ("loaded", "one-token"):
        assert seen["with-finishes"] > 0, seen
        assert seen["pure-finishes"] > 0, seen
        assert seen["several-with-finishes"] > 0, seen
    if name in ("one-token", "small-budget"):
        assert seen["several-finished"] > 0, seen


def decoding_row(i: int, prompt: int, target: int, blocks: int, room: int) -> SimpleNamespace:
    """A request past its prefill with one token out, as RunningRows sees it: ``blocks`` KV
    blocks, ``room`` positions left in its last one, ``target`` tokens to make."""
    return SimpleNamespace(
        id=i,
        prompt_tokens=prompt,
        max_tokens=prompt + 500,
        target_tokens=target,
        num_computed=prompt,
        num_output=1,
        num_blocks=blocks,
        block_room=room,
        lazy_base=0,
    )


def _ids(cal: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """A calendar with each request named by its id (two sides' objects differ)."""
    return {
        k: [(x[0].id, x[1]) if isinstance(x, tuple) else x.id for x in v] for k, v in cal.items()
    }


def test_one_row_starts_as_start_decoding() -> None:
    """``RunningRows.start_one`` (the end of an admission step, decode_runs Rule 5) leaves
    the same fields, calendars and sums as ``start_decoding`` of that one row: random
    rows with prompts in and past the private blocks' table, fresh and grown."""
    w = Engine(deployment(GPT_OSS_20B)).workers[0]
    rf = w.roofline
    rnd = random.Random(5)
    fields = ("num_computed", "num_output", "lazy_base", "block_room", "num_blocks")
    for _ in range(300):
        g = rnd.randrange(0, 50)
        seed = rnd.random()
        sides = []
        for _side in range(2):
            vec = RunningRows([], rf.room_for, windows=rf.window_classes(), flat=w.room_flat)
            vec.g = g
            rows = random.Random(seed)
            made = []
            for i in range(rows.randrange(1, 5)):
                prompt = rows.choice([3, 40, 127, 128, 129, 700, 5000])
                blocks = rows.choice([0, rf.blocks_for(prompt), rf.blocks_for(prompt) + 1])
                target = rows.randrange(1, 400)
                room = 0 if rows.random() < 0.7 else rf.room_for(blocks)
                made.append(decoding_row(i, prompt, target, blocks, room))
                vec.append(1)
            sides.append((vec, made))
        (one, made_one), (many, made_many) = sides
        for r, q in zip(made_one, made_many, strict=True):
            one.start_one(r)
            many.start_decoding((q,))
            for name in fields:
                assert getattr(r, name) == getattr(q, name), name
        for slot in RunningRows.__slots__:
            a, b = getattr(one, slot), getattr(many, slot)
            if slot in ("finish_cal", "grow_cal"):
                a, b = _ids(a), _ids(b)
            assert a == b, slot


def test_terms_of_one_admission_as_the_general_terms() -> None:
    """``RunningRows.terms_with_one`` (a lean admission's price terms, decode_runs Rule 4),
    unrolled for full attention and one sliding window, gives the integers of its general
    loop and of ``terms_with``: random decoding rows, chunks in and past the window."""
    w = Engine(deployment(GPT_OSS_20B)).workers[0]
    rf = w.roofline
    rnd = random.Random(7)
    for _ in range(200):
        vec = RunningRows([], rf.room_for, windows=rf.window_classes(), flat=w.room_flat)
        assert vec.two > 0
        rows = []
        for i in range(rnd.randrange(1, 12)):
            prompt = rnd.choice([3, 60, 126, 127, 128, 129, 700])
            r = decoding_row(i, prompt, rnd.randrange(2, 400), rf.blocks_for(prompt + 1), 0)
            vec.append(1)
            rows.append(r)
        vec.start_decoding(rows)
        vec.g = rnd.randrange(0, 3)
        n, c = rnd.choice([1, 5, 64, 200, 3000]), rnd.choice([0, 50, 127, 128, 900])
        one = vec.terms_with_one(n, c)
        general = vec.terms_with([n], [c])
        vec.two = 0
        loop = vec.terms_with_one(n, c)
        for terms in (general, loop):
            assert (one.tokens, one.seqs, one.sums, one.mla) == (
                terms.tokens,
                terms.seqs,
                terms.sums,
                terms.mla,
            )


@pytest.mark.parametrize("caching", [False, True])
def test_plain_admissions_as_admit(caching: bool) -> None:
    """A lean admission's ``KVCacheManager.admit_plain`` (lean_admission Rule 1) sets the
    request's and the pool's fields as ``admit`` with no hit: random plain requests, first
    admissions and again after a preemption, with prefix caching's counts on and off."""
    rnd = random.Random(11)
    for _ in range(100):
        sides = []
        prompt, out, first = rnd.randrange(1, 900), rnd.choice([0, 1, 2, 40]), rnd.random() < 0.5
        blocks = rnd.randrange(0, 9)
        for lean in (False, True):
            w = Engine(deployment(GPT_OSS_20B, enable_prefix_caching=caching)).workers[0]
            kv = w.kv
            r = SimpleNamespace(
                prompt_tokens=prompt, num_output=out, cached_tokens=-5, num_blocks=0,
                cacheable_blocks=0, num_computed=0,
            )  # fmt: skip
            if lean:
                kv.admit_plain(r, blocks, first)
            else:
                kv.admit(r, 0, blocks, first)
            pool = kv.pool
            sides.append((vars(r), pool.free, pool.queries, pool.hits, pool.filling))
        assert sides[0] == sides[1]


@pytest.mark.parametrize("dep", [(GPT_OSS_20B, "b200"), (DEEPSEEK_R1, "h200")])
def test_plain_price_is_price(dep: tuple[Any, str]) -> None:
    """``Roofline.plain_price`` (lean_admission Rule 2) is the price ``price`` gives where
    it is its common case, and None for an MLA model (whose price is not)."""
    rf = Engine(load_deployment(*dep)).workers[0].roofline
    if rf.has_mla():
        assert rf.plain_price is None
        return
    assert rf.plain_price is not None
    rnd = random.Random(5)
    for _ in range(100):
        seqs = rnd.randrange(1, 300)
        terms = rf.batch_terms(
            [rnd.choice([1, 1, 1, 64, 700]) for _ in range(seqs)],
            [rnd.randrange(0, 5000) for _ in range(seqs)],
        )
        cost = rf.plain_price(terms.tokens, terms.seqs, terms.sums)
        assert cost == rf.price(terms)
