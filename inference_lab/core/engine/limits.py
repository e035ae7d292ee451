"""The limits a request can never pass on a deployment, checked before it is admitted.

Rule 1: a request that can never run is refused at submission (``RequestRefused``, the
        serving layer's 400 ``context_length_exceeded``), never left to wait forever:
        its prompt plus ``max_tokens`` past the model's ``max_seq_len``; more KV blocks
        than a replica holds (its ``n`` sequences' blocks, shared prompt blocks counted
        once); ``n`` wider than the step's token budget; with chunked prefill off, a stage
        that must run in one step larger than the budget.
Rule 2: every check of a plain request is a bound on its total (prompt + max_tokens) that
        does not decrease with it, so :func:`fits_total` -- the largest total that passes
        them all -- lets the engine skip the checks for a request within it.
"""

from __future__ import annotations

from inference_lab.core.config import Deployment
from inference_lab.core.engine.kv_cache_manager import KVCacheManager
from inference_lab.core.roofline import Roofline
from inference_lab.errors import RequestRefused

__all__ = ["check_fits", "fits_total"]


def fits_total(dep: Deployment, roofline: Roofline) -> int:
    """The largest prompt + max_tokens of a plain request that passes every check (Rule 2)."""
    sched = dep.scheduler
    return min(
        dep.model.max_seq_len,
        roofline.room_for(roofline.total_blocks),
        (sched.max_num_batched_tokens + 1) if not sched.enable_chunked_prefill else 1 << 62,
    )


def check_fits(
    dep: Deployment, kv: KVCacheManager, prompt_tokens: int, max_tokens: int, n: int = 1
) -> RequestRefused | None:
    """Why a request of this size (``n`` sequences sharing the prompt) can never run on
    ``dep`` (Rule 1), or None. ``kv``: a worker's KV cache manager (they all count blocks
    alike)."""
    total = prompt_tokens + max_tokens
    if total > dep.model.max_seq_len:
        return RequestRefused(
            "max_seq_len",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
            f"exceeds the model's max_seq_len of {dep.model.max_seq_len}",
        )
    blocks = kv.blocks_for(total)
    if n > 1:
        shared = prompt_tokens // kv.block_size
        blocks = shared + n * (blocks - shared)
    if blocks > kv.pool.total:
        what = f"{total} tokens" if n == 1 else f"{total} tokens in each of n = {n} sequences"
        return RequestRefused(
            "kv_cache",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {what} "
            f"need {blocks} KV blocks but a replica's KV cache holds "
            f"{kv.pool.total}",
        )
    sched = dep.scheduler
    budget = sched.max_num_batched_tokens
    if n > budget:
        return RequestRefused(
            "batch_tokens",
            f"n = {n} sequences cannot decode together in max_num_batched_tokens ({budget})",
        )
    if not sched.enable_chunked_prefill:
        # the largest stage that must run in one step: a plain request's whole
        # re-prefill; a group's prompt, or its n re-prefilled outputs
        largest = total - 1 if n == 1 else max(prompt_tokens, n * (max_tokens - 1))
        if largest > budget:
            return RequestRefused(
                "batch_tokens",
                f"prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) need "
                f"{largest} positions in one step, more than max_num_batched_tokens "
                f"({budget}) with chunked prefill disabled",
            )
    return None
