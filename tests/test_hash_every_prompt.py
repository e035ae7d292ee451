"""``[scheduler] hash_every_prompt``: a preempted request without hashes keeps its
computed blocks cached, as vLLM's prefix cache keeps every request's
(``core/engine/kv_cache_manager.py`` Rule 5; docs/fidelity.md).

The deployment is Llama-3.1-8B's (16-token blocks) with a KV cache of seven blocks: two
32-token prompts growing to 62 positions each cannot both finish resident, so the later
one is preempted, after 17 tokens, holding 48 positions (three full blocks).
"""

from __future__ import annotations

from inference_lab.core.engine import Engine
from inference_lab.core.engine.kv_cache_manager import private_chain
from tests.engine_util import (
    assert_blocks_conserved,
    deployment,
    finished,
    run,
    spec,
    tokens_by_request,
)


def positions_and_hits(**scheduler: bool) -> tuple[int, int, int]:
    """The positions every step computed, the prefix-cache hit tokens and the later
    request's preemptions, for the two hashless requests of the module docstring."""
    eng = Engine(deployment(blocks=7, **scheduler))
    a = eng.submit(spec(32, 30))
    b = eng.submit(spec(32, 30))
    events = []
    while eng.next_event_time() is not None:
        events.append(eng.step())
        assert_blocks_conserved(eng)
    assert tokens_by_request(events) == {a: 30, b: 30}
    assert eng.workers[0].free_blocks == 7
    positions = sum(ev.step.num_tokens for ev in events if ev.step)
    return positions, eng.statistics().prefix_cache_hits, finished(events)[b].preemptions


#: Off: the blocks the later request frees are empty, so it is readmitted at once onto
#: them, recomputes its 48 positions beside the other's decode, finds no block for its
#: next position and preempts itself again: seven times, until the other finishes (the
#: thrash of docs/fidelity.md), 7 x 48 positions computed twice; 2 x 61 for the tokens.
THRASH = (2 * 61 + 7 * 48, 0, 7)


def test_a_hashless_preempted_request_recomputes_by_default() -> None:
    assert positions_and_hits() == THRASH
    assert positions_and_hits(hash_every_prompt=False) == THRASH


def test_hash_every_prompt_resumes_it_from_its_cached_blocks() -> None:
    """On: its three full blocks (48 positions) are cached when it is preempted, so its
    readmission needs them and one block more, more than are free: it waits for the other
    to finish, then finds all 48 and computes nothing twice: one preemption, 2 x 61
    positions in all, 48 hit tokens."""
    assert positions_and_hits(hash_every_prompt=True) == (2 * 61, 48, 1)


def test_hash_every_prompt_needs_prefix_caching() -> None:
    """With prefix caching off nothing is cached, the flag notwithstanding."""
    assert positions_and_hits(hash_every_prompt=True, enable_prefix_caching=False) == THRASH


def test_a_hashed_request_keeps_its_own_chain() -> None:
    """A request that carries hashes is preempted as before: its own chain is cached (the
    flag gives a chain only to a request without one)."""
    counts = []
    for flag in (False, True):
        eng = Engine(deployment(blocks=7, hash_every_prompt=flag))
        eng.submit(spec(32, 30, block_hashes=tuple(range(100, 108))))
        b = eng.submit(spec(32, 30, block_hashes=tuple(range(200, 208))))
        events = run(eng)
        counts.append((sum(ev.step.num_tokens for ev in events if ev.step), finished(events)[b]))
    assert counts[0] == counts[1]


def test_private_chains_are_distinct_and_stable() -> None:
    """A private chain is one 8-byte hash per block, the same for the same request id and
    shared by no two ids or blocks."""
    one, two = private_chain(1, 4), private_chain(2, 4)
    assert one == private_chain(1, 4)
    assert len(one) == 4 and len(set(one) | set(two)) == 8
    assert all(0 <= h < 2**64 for h in one + two)
    assert private_chain(3, 0) == ()


def test_the_vllm_entries_hash_every_prompt() -> None:
    """The calibrated vLLM entries model vLLM's prefix cache (on by default in its V1
    engine, every request hashed); the datasheet entries keep the default."""
    from inference_lab.core.config import load_deployment
    from tests.engine_util import GPT_OSS_20B, ROOT

    assert load_deployment(
        ROOT / "configs" / "gpt-oss-120b.toml", "h100-vllm"
    ).scheduler.hash_every_prompt
    assert load_deployment(GPT_OSS_20B, "h100-vllm").scheduler.hash_every_prompt
    assert not load_deployment(GPT_OSS_20B, "h200").scheduler.hash_every_prompt
