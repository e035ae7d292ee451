"""``Engine.submit_plain`` is ``submit`` of a plain spec without the spec (engine Rule 8):
the same request, filed the same way, and the same answer to what is refused or
malformed.

Two engines take the same random arrivals, one through ``submit(RequestSpec(...),
preorder=i)`` and the other through ``submit_plain``; every field of every request and
every calendar entry must be equal, on deployments with and without the prefix cache and
the frontend latency, with arrivals later than the engine's clock, too long ones
(refused) and malformed ones.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from inference_lab.core.config import Deployment
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.core.engine.request import Request
from inference_lab.errors import RequestRefused
from tests.engine_util import GPT_OSS_20B, LLAMA8B, deployment, run

DEPLOYMENTS: dict[str, Any] = {
    "llama": lambda: deployment(LLAMA8B),
    "gpt-oss": lambda: deployment(GPT_OSS_20B),
    "frontend-latency": lambda: deployment(GPT_OSS_20B, frontend_latency=0.003),
    "no-prefix-cache": lambda: deployment(LLAMA8B, enable_prefix_caching=False),
    "small": lambda: deployment(LLAMA8B, blocks=64),
}


def _answer(call: Any) -> Any:
    """What a submission answers: an id, or the exception it raised (type and text)."""
    try:
        return call()
    except (RequestRefused, ValueError) as exc:
        return (type(exc), str(exc), getattr(exc, "limit", None))


def _fields(r: Request) -> list[Any]:
    return [getattr(r, name) for name in Request.__slots__]


def _arrivals(seed: int, count: int) -> list[tuple[int, int, float]]:
    """Random (prompt, length, time): mostly plain, some malformed (0) or too long."""
    rnd = random.Random(seed)
    out = []
    t = 0.0
    for _ in range(count):
        t += rnd.expovariate(50.0)
        prompt = rnd.choice([0, 1, 7, 300, 2000, 5000, 200_000]) if rnd.random() < 0.2 else 0
        prompt = prompt or rnd.randint(1, 3000)
        length = rnd.choice([0, 1, 4096, 300_000]) if rnd.random() < 0.1 else 0
        out.append((prompt, length or rnd.randint(1, 800), t))
    return out


def _submit_both(dep: Deployment, seed: int) -> tuple[Engine, Engine, int]:
    """The same arrivals through both ways, some after the engines moved on; the count of
    requests taken."""
    by_spec, plain = Engine(dep), Engine(dep)
    taken = 0
    for i, (p, o, t) in enumerate(_arrivals(seed, 300)):
        spec = RequestSpec(prompt_tokens=p, max_tokens=o, arrival_time=t)
        a = _answer(lambda spec=spec, i=i: by_spec.submit(spec, preorder=i))
        b = _answer(lambda p=p, o=o, t=t, i=i: plain.submit_plain(p, o, t, i))
        assert a == b
        taken += isinstance(a, int)
        if i % 50 == 49:  # (both step on: the next arrivals come before their clock)
            run(by_spec, until=t + 0.5)
            run(plain, until=t + 0.5)
    return by_spec, plain, taken


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_submit_plain_is_submit_of_a_plain_spec(name: str, seed: int) -> None:
    """Every request's fields and every calendar entry the same, and the same answers."""
    dep = DEPLOYMENTS[name]()
    by_spec, plain, taken = _submit_both(dep, seed)
    assert taken > (50 if name == "small" else 200)  # (and some refused or malformed)
    assert by_spec._requests.keys() == plain._requests.keys()
    for rid, r in by_spec._requests.items():
        assert _fields(r) == _fields(plain._requests[rid]), rid
    cal_a, cal_b = by_spec._calendar.heap, plain._calendar.heap
    assert [e[:3] for e in cal_a] == [e[:3] for e in cal_b]
    run(by_spec)
    run(plain)
    assert by_spec.statistics() == plain.statistics()
