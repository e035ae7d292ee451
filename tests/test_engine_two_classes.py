"""The stretch specialised for two window classes (``core/engine/stretch.py`` Rule 3,
``core/decode_pricing.py`` Rule 3) is the step-by-step engine, to the bit.

gpt-oss-20b has full attention and a 128-token sliding window, the shape the specialised
stretch takes. Random workloads (aborts and late submissions between random cutoffs,
preemption with a small pool, prefix hits, groups, short prompts whose windows saturate
inside stretches) go through ``run_until`` and through ``step()`` one event at a time
(``tests/test_engine_runs.py``'s driver) and must give the same steps, figures,
completions and state; the same workloads through ``run_until`` with the specialisation
switched off (the general stretch and its pricer) must too. The specialised stretch is
counted by how it ended, so a comparison that never reached a case fails.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from inference_lab.core.decode_pricing import DecodeStep, decode_step
from inference_lab.core.engine import Engine
from inference_lab.core.engine import decode_runs as runs_module
from inference_lab.core.engine import stretch as stretch_module
from inference_lab.core.roofline import Roofline
from tests.engine_util import GPT_OSS_20B, LLAMA8B, deployment
from tests.test_engine_runs import _drive, _same, _specs

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "light": ({}, {"rate": 60.0, "prompt_mu": 6.9, "output_mu": 5.3}),
    "loaded": ({}, {"rate": 250.0, "prompt_mu": 6.9, "output_mu": 5.3}),
    "saturating-windows": ({}, {"rate": 60.0, "prompt_mu": 3.5, "output_mu": 5.3}),
    "preemption": ({"blocks": 700}, {"rate": 80.0, "prompt_mu": 6.9, "output_mu": 5.3}),
    "short-blocks": ({"blocks": 900}, {"rate": 80.0, "prompt_mu": 6.9, "output_mu": 5.3}),
    "prefix-hits": ({}, {"rate": 100.0, "hashes": True, "output_mu": 5.0}),
    "groups": ({}, {"rate": 100.0, "groups": True, "output_mu": 5.0}),
}


def _count(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the specialised stretches' steps, how each ended, and saturations crossed."""
    seen: Counter[str] = Counter()
    original = stretch_module._two_classes

    def counting(worker: Any, vec: Any, k: Any, now: float, limit: float, *a: Any) -> Any:
        unsat = list(vec.unsat)
        run = original(worker, vec, k, now, limit, *a)
        seen["steps"] += run.started
        seen["short" if run.short else "limit" if run.end >= limit else "finish"] += 1
        seen["saturated"] += vec.unsat != unsat and run.boundaries > 0
        return run

    monkeypatch.setattr(stretch_module, "_two_classes", counting)
    return seen


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_two_class_stretch_is_step_by_step(
    monkeypatch: pytest.MonkeyPatch, name: str, seed: int
) -> None:
    """Each workload: ``run_until`` (specialised stretches) gives what ``step()`` gives and
    what the general stretch gives; the specialised one ran and ended for each reason
    the workload has."""
    dep_kw, kw = CASES[name]
    dep = deployment(GPT_OSS_20B, **dep_kw)
    specs = _specs(500, seed, **kw)
    seen = _count(monkeypatch)
    stepped = _drive(dep, specs, seed, runs=False)
    assert seen["steps"] == 0  # (step() takes no stretch)
    ran = _drive(dep, specs, seed, runs=True)
    _same(stepped, ran)
    if name not in ("groups", "prefix-hits"):  # (those keep a worker off the fast path)
        assert seen["steps"] > 0 and seen["limit"] > 0 and seen["finish"] > 0, seen
    if name == "short-blocks":
        assert seen["short"] > 0, seen
    if name == "saturating-windows":
        assert seen["saturated"] > 0, seen

    def general(k: Any) -> DecodeStep:
        return DecodeStep(decode_step(k).price, None)

    monkeypatch.setattr(runs_module, "decode_step", general)
    before = seen["steps"]
    _same(stepped, _drive(dep, specs, seed, runs=True))
    assert seen["steps"] == before  # (the general stretch took them all)


def test_only_two_classes_get_the_inline_constants() -> None:
    """gpt-oss (full attention and a sliding window) gets the inline constants, whose
    arithmetic gives the pricer's floats; Llama (full attention only) does not."""
    rf = Roofline(deployment(GPT_OSS_20B))
    for rows in (1, 12, 200):
        k = rf.decode_constants(rows)
        assert k is not None
        step = decode_step(k)
        two = step.two
        assert two is not None
        s0, s1 = 1_000 * rows + 7, 128 * rows - 3
        tc = (two.fa0 + two.a0 * s0 + two.a1 * s1) / two.attn_rate
        tm = (two.ma0 + two.k0 * s0 + two.k1 * s1 + two.state) / two.bandwidth
        roof = two.roof0 + max(tc, tm) + two.most_after + two.tail + two.seq
        assert step.price([s0, s1]) == (
            two.alpha * roof + two.beta,
            roof,
            (two.compute0 + tc + two.c_after) * two.eta_flops,
            (two.memory0 + tm + two.m_after) * two.eta_bw,
        )
    k = Roofline(deployment(LLAMA8B)).decode_constants(8)
    assert k is not None
    assert decode_step(k).two is None


@pytest.mark.parametrize(
    ("dep_kw", "kw"),
    [
        ({"blocks": 700}, {"rate": 80.0, "prompt_mu": 6.9, "output_mu": 5.3}),
        ({}, {"rate": 250.0, "prompt_mu": 6.9, "output_mu": 5.3}),
        ({}, {"rate": 100.0, "groups": True, "hashes": True, "output_mu": 5.0}),
    ],
)
def test_running_requests_stay_in_admission_order(
    dep_kw: dict[str, Any], kw: dict[str, Any]
) -> None:
    """``complete_fast`` finds a finishing row by bisecting ``running`` on the requests'
    admission numbers: after every step of workloads with preemptions, aborts, groups
    and prefix hits, each worker's running requests are in increasing admission order."""
    eng = Engine(deployment(GPT_OSS_20B, **dep_kw))
    ids = [eng.submit(s) for s in _specs(400, 9, **kw)]
    preempted = 0
    for i in range(100_000):
        ev = eng.step()
        if ev.step is not None:
            preempted += ev.step.preempted
        for w in eng.workers:
            orders = [r.admit_order for r in w.running]
            assert orders == sorted(set(orders)), i
        if i % 97 == 0:
            eng.abort(ids[i % len(ids)])
        if eng.next_event_time() is None:
            break
    assert eng.is_idle()
    if dep_kw:
        assert preempted > 0
