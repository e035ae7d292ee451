"""Stretches of pure decode steps (``core/engine/stretch.py``) and the decode pricer they
call (``core/decode_pricing.py``) are the step-by-step engine, to the bit.

The pricer is compared with the roofline's general price of the same batch on every
shipped plain configuration, and its unrolled forms with its general loop on random
constants. The stretches are compared, through ``run_until``, with ``step()`` one event
at a time (``tests/test_engine_runs.py``'s driver) on workloads where they end for every
reason they can end (the next event, a finish, KV blocks short), cross sliding-window
saturations and, on gpt-oss's two classes, go on across finishes; each reason is counted,
so a comparison that never reached it fails.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import attrs
import pytest

from inference_lab.core.config import Overheads, load_deployment
from inference_lab.core.decode_pricing import DecodeConstants, decode_price_function
from inference_lab.core.engine import Engine
from inference_lab.core.engine import fast_path as fast_module
from inference_lab.core.roofline import BatchTerms, Roofline
from inference_lab.sim.records import StepTotals
from tests.engine_util import GPT_OSS_20B, LLAMA8B, ROOT, deployment
from tests.test_engine_runs import _drive, _same, _specs

PLAIN_CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("config", PLAIN_CONFIGS, ids=lambda p: p.stem)
def test_the_decode_pricer_is_the_roofline_price(config: Any) -> None:
    """Random row counts and sums: the pricer's four floats are ``Roofline.price``'s for
    ``BatchTerms(rows, rows, [[t, t], ...])``, bit for bit."""
    rf = Roofline(load_deployment(config, "b200"))
    classes = len(rf.window_classes())
    rnd = random.Random(config.stem)
    for _ in range(300):
        rows = rnd.randint(1, 300)
        pricer = rf.decode_pricer(rows)
        assert pricer is not None
        sums = [rnd.randint(rows, rows * 20_000) for _ in range(classes)]
        cost = rf.price(BatchTerms(rows, rows, [[t, t] for t in sums], []))
        got = pricer(sums)
        assert got == (cost.seconds, cost.roofline, cost.compute, cost.memory)


def _reference(k: DecodeConstants, sums: list[int]) -> tuple[float, float, float, float]:
    """``Roofline._plain_price``'s order of operations for a pure decode step."""
    fa, ma = k.fa0, k.ma0
    for (attn_coef, kv_coef), total in zip(k.coefs, sums, strict=True):
        fa += attn_coef * float(total)
        ma += kv_coef * float(total)
    ma += k.state
    tc = fa / k.attn_rate
    tm = ma / k.bandwidth
    compute = k.compute0 + tc
    memory = k.memory0 + tm
    roof = k.roof0 + (tc if tc > tm else tm)
    for c, m in k.after:
        compute += c
        memory += m
        roof += c if c > m else m
    roof += k.tail
    if k.seq:
        roof += k.seq
    return k.alpha * roof + k.beta, roof, compute * k.eta_flops, memory * k.eta_bw


@pytest.mark.parametrize("classes", [1, 2, 3])
@pytest.mark.parametrize("streams", [0, 1, 2])
def test_every_form_of_the_pricer_keeps_the_order(classes: int, streams: int) -> None:
    """Random constants (either side of each ``max``): the unrolled forms and the general
    loop give the reference's floats to the bit."""
    rnd = random.Random(classes * 10 + streams)
    for _ in range(400):
        u = rnd.uniform
        k = DecodeConstants(
            fa0=u(0, 1e12),
            ma0=u(0, 1e11),
            coefs=tuple((u(0, 1e7), u(0, 1e6)) for _ in range(classes)),
            state=rnd.choice([0.0, u(0, 1e8)]),
            attn_rate=u(1e14, 1e16),
            bandwidth=u(1e12, 1e13),
            compute0=rnd.choice([0.0, u(0, 1e-3)]),
            memory0=rnd.choice([0.0, u(0, 1e-3)]),
            roof0=rnd.choice([0.0, u(0, 1e-3)]),
            after=tuple((u(0, 1e-3), u(0, 1e-3)) for _ in range(streams)),
            tail=u(0, 1e-4),
            seq=rnd.choice([0.0, u(0, 1e-2)]),
            alpha=u(0.5, 1.5),
            beta=u(0, 1e-4),
            eta_flops=u(0.5, 1.0),
            eta_bw=u(0.5, 1.0),
        )
        sums = [rnd.randint(1, 5_000_000) for _ in range(classes)]
        assert decode_price_function(k)(sums) == _reference(k, sums)


def _count_stretches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the stretches by how they ended, and those that crossed a saturation."""
    seen: Counter[str] = Counter()
    original = fast_module.decode_stretch

    def counting(worker: Any, vec: Any, pricer: Any, now: float, limit: float, *a: Any) -> Any:
        unsat = list(vec.unsat)
        ended = a[2] if len(a) > 2 else None
        before = 0 if ended is None else len(ended)
        run = original(worker, vec, pricer, now, limit, *a)
        seen["steps"] += run.started
        seen["long"] += run.started >= 10
        seen["short" if run.short else "limit" if run.end >= limit else "finish"] += 1
        seen["saturated"] += vec.unsat != unsat and run.boundaries > 0
        seen["inside"] += ended is not None and len(ended) > before  # (Rule 4)
        return run

    monkeypatch.setattr(fast_module, "decode_stretch", counting)
    return seen


@pytest.mark.parametrize(
    ("name", "make", "kw"),
    [
        ("light", lambda: deployment(GPT_OSS_20B), {"prompt_mu": 6.9, "output_mu": 5.3}),
        ("windows", lambda: deployment(GPT_OSS_20B), {"prompt_mu": 3.5, "output_mu": 5.3}),
        (
            "short-blocks",
            lambda: deployment(GPT_OSS_20B, blocks=900),
            {"rate": 80.0, "prompt_mu": 6.9, "output_mu": 5.3},
        ),
        ("full-attention", lambda: deployment(LLAMA8B), {"output_mu": 5.3}),
    ],
)
def test_stretches_are_step_by_step(
    monkeypatch: pytest.MonkeyPatch, name: str, make: Any, kw: dict[str, Any]
) -> None:
    """Each workload through ``run_until`` (stretches) and through ``step()``: the same
    steps, figures, completions and state; the stretches ran long and ended for each
    reason (blocks short only where the pool is small), and crossed window saturations
    where prompts are shorter than gpt-oss's 128-token window."""
    seen = _count_stretches(monkeypatch)
    dep = make()
    specs = _specs(600, 7, **{"rate": 60.0, **kw})
    stepped = _drive(dep, specs, 7, runs=False)
    assert seen["steps"] == 0  # (step() takes no stretch)
    ran = _drive(dep, specs, 7, runs=True)
    _same(stepped, ran)
    assert seen["long"] > 0 and seen["limit"] > 0, seen
    if name == "full-attention":  # (the general stretch ends at a finish)
        assert seen["finish"] > 0, seen
    else:  # (gpt-oss's two classes: finishes inside the stretch, Rule 4)
        assert seen["inside"] > 0, seen
    if name == "short-blocks":
        assert seen["short"] > 0, seen
    if name == "windows":
        assert seen["saturated"] > 0, seen


@pytest.mark.parametrize("seed", [3, 4, 5])
@pytest.mark.parametrize(
    ("rate", "kw"),
    [
        (60.0, {"prompt_mu": 6.9, "output_mu": 4.0}),
        (150.0, {"output_mu": 4.5}),
        (400.0, {"prompt_mu": 3.5, "output_mu": 3.5}),
    ],
)
def test_finishes_inside_stretches_are_step_by_step(
    monkeypatch: pytest.MonkeyPatch, seed: int, rate: float, kw: dict[str, Any]
) -> None:
    """stretch Rule 4: random gpt-oss workloads with short outputs (many finishes, some
    leaving too few rows for the fast path, some at a boundary that also grows a row or
    saturates its window) through ``run_until`` and through ``step()`` one event at a
    time: the same steps, figures, completions and state, and most finishes were taken
    inside a stretch."""
    seen = _count_stretches(monkeypatch)
    dep = deployment(GPT_OSS_20B)
    specs = _specs(400, seed, rate=rate, **kw)
    stepped = _drive(dep, specs, seed, runs=False)
    ran = _drive(dep, specs, seed, runs=True)
    _same(stepped, ran)
    assert seen["inside"] > 20, seen


def test_a_stretch_takes_most_steps_at_60_per_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's shape (gpt-oss-20b at 60 requests/s): most steps are started by
    stretches, not one boundary at a time."""
    seen = _count_stretches(monkeypatch)
    eng = Engine(deployment(GPT_OSS_20B))
    for s in _specs(800, 3, rate=60.0, prompt_mu=6.9, output_mu=5.3):
        eng.submit(s)
    totals = StepTotals()
    eng.run_until(math.inf, totals, [])
    assert seen["steps"] > len(totals) * 0.7, (seen, len(totals))


def test_a_per_sequence_overhead_is_priced_in_decode_runs_too() -> None:
    """A calibrated entry with ``[overheads] seq_overhead`` (gpt-oss-20b on ``h100-vllm``):
    the decode pricer adds it per row as ``Roofline.price`` does, to the bit, and
    ``run_until`` gives what ``step()`` gives. Each step costs ``seq_overhead`` per
    sequence more than the same entry without it."""
    dep = load_deployment(ROOT / "configs" / "gpt-oss-20b.toml", "h100-vllm")
    seq = dep.overheads.seq_overhead
    assert seq > 0
    rf = Roofline(dep)
    rnd = random.Random(5)
    for rows in (1, 8, 64):
        pricer = rf.decode_pricer(rows)
        assert pricer is not None
        sums = [rnd.randint(rows, rows * 20_000) for _ in rf.window_classes()]
        cost = rf.price(BatchTerms(rows, rows, [[t, t] for t in sums], []))
        assert pricer(sums) == (cost.seconds, cost.roofline, cost.compute, cost.memory)
    specs = _specs(300, 5, rate=20.0, prompt_mu=6.9, output_mu=5.3)
    _same(_drive(dep, specs, 5, runs=False), _drive(dep, specs, 5, runs=True))
    plain = Roofline(attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, overheads=Overheads())))
    terms = BatchTerms(8, 8, [[4_000, 4_000] for _ in rf.window_classes()], [])
    assert rf.price(terms).roofline == pytest.approx(plain.price(terms).roofline + 8 * seq)
