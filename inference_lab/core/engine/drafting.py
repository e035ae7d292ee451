"""Speculative decoding's verify steps, and the price of a step with its drafter.

Rule 1: with ``[speculative]``, a decoding sequence's step computes its verify width ``1 +
        gamma`` positions (gamma capped so that it never passes ``max_tokens``, and by the
        step's token budget: the scheduler chooses it) and reserves their KV blocks and
        budget; when the batch is chosen its accepted count is drawn from the engine's own
        seeded draws (:mod:`inference_lab.core.speculative`; a group draws once for its
        sequences) and its batch entry becomes the ``1 + accepted`` positions it advances
        by at the step's end, capped by its remaining length. The blocks of rejected
        positions stay held until the request ends, is preempted or aborted; prefill
        chunks and a step's admissions never draft.
Rule 2: a speculative step costs its verify batch plus its drafter (the roofline's Rule 7);
        ``plain_duration`` is what its tokens would cost without speculation: the batch
        without drafts, then ``accepted / drafts`` more steps of one position per drafting
        sequence (the speed-up estimate's reference).
Rule 3: a lockstep step of data-parallel ranks is priced once over all of them (the
        roofline's Rule 6), its drafter over every rank's drafting sequences at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from inference_lab.core.engine.request import Request
from inference_lab.core.engine.scheduler import Scheduler
from inference_lab.core.roofline import Roofline, StepCost
from inference_lab.core.speculative import AcceptanceDraws

__all__ = ["DraftCounts", "draft", "plain_equivalent", "price_lockstep", "price_step"]


@attrs.define
class DraftCounts:
    """A step's drafts, counted per sequence (vLLM's counters): drafting sequences, their
    draft tokens, the accepted ones, and how many accepted each position ``j``."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    per_position: list[int] = attrs.field(factory=list)

    def add(self, other: DraftCounts) -> None:
        """Add another rank's counts (a lockstep step)."""
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        per = self.per_position
        for j, value in enumerate(other.per_position):
            if j < len(per):
                per[j] += value
            else:
                per.append(value)


def draft(
    rf: Roofline, accept: AcceptanceDraws, w: Scheduler, batch: list[tuple[Request, int]]
) -> DraftCounts:
    """Rule 1, when ``w``'s batch is chosen: draw each verifying member's accepted count,
    turn its batch entry into the positions it will have computed at the step's end, and
    keep the step's terms with and without drafts on ``w``."""
    ns: list[int] = []
    pns: list[int] = []
    dcs: list[int] = []
    seq_cs: list[int] = []
    counts = DraftCounts()
    per = counts.per_position
    for i, (r, n) in enumerate(batch):
        c = r.num_computed
        seqs = 1 if r.n == 1 or c < r.prompt_tokens else r.n
        width = n
        if n > 1 and c >= r.prefill_length():
            gamma = n - 1
            accepted = accept.draw(gamma)
            advance = 1 + accepted
            remaining = r.target_tokens - r.num_output
            batch[i] = (r, advance if advance < remaining else remaining)
            counts.drafts += seqs
            counts.draft_tokens += seqs * gamma
            counts.accepted_tokens += seqs * accepted
            while len(per) < accepted:
                per.append(0)
            for j in range(accepted):
                per[j] += seqs
            dcs.extend([c] * seqs)
            width = 1
        if seqs == 1:
            ns.append(n)
            pns.append(width)
            seq_cs.append(c)
        else:
            ns.extend([n] * seqs)
            pns.extend([width] * seqs)
            seq_cs.extend([c] * seqs)
    w.step_terms = rf.batch_terms(ns, seq_cs)
    if dcs:
        w.step_plain = rf.batch_terms(pns, seq_cs)
        w.step_pns, w.step_cs, w.step_dcs = pns, seq_cs, dcs
    else:
        w.step_plain = None
        w.step_pns, w.step_cs, w.step_dcs = [], [], []
    return counts


def plain_equivalent(
    rf: Roofline, plain: StepCost, ranks: Sequence[Scheduler], counts: DraftCounts, factor: float
) -> float:
    """The seconds a step's tokens would take without speculation (Rule 2): its
    ``StepInfo``'s ``plain_duration``. Only for the speed-up estimate."""
    drafts = counts.drafts
    if not drafts:
        return plain.seconds * factor
    terms = [rf.batch_terms([1] * len(w.step_dcs), [c + 1 for c in w.step_dcs]) for w in ranks]
    decode = rf.group_price(terms) if len(ranks) > 1 else rf.price(terms[0])
    return (plain.seconds + counts.accepted_tokens / drafts * decode.seconds) * factor


def price_step(rf: Roofline, w: Scheduler) -> tuple[StepCost, StepCost]:
    """The step in flight of ``w`` with its drafter, and without drafts."""
    terms = w.step_terms
    assert terms is not None
    cost = rf.price(terms)
    if w.step_plain is None:
        return cost, cost
    plain = rf.price(w.step_plain)
    drafted = rf.draft_time(plain.roofline, w.step_pns, w.step_cs, w.step_dcs, w.step_gamma)
    return rf.with_draft(cost, drafted), plain


def price_lockstep(rf: Roofline, ranks: Sequence[Scheduler]) -> tuple[StepCost, StepCost]:
    """The lockstep step of ``ranks`` (Rule 3), with its drafters, and without drafts."""
    empty = rf.batch_terms([], [])
    terms = [w.step_terms if w.step_terms is not None else empty for w in ranks]
    cost = rf.group_price(terms)
    if all(w.step_plain is None for w in ranks):
        return cost, cost
    plain = rf.group_price(
        [w.step_plain if w.step_plain is not None else t for w, t in zip(ranks, terms, strict=True)]
    )
    pns: list[int] = []
    cs: list[int] = []
    dcs: list[int] = []
    for w in ranks:
        if w.step_plain is not None:
            pns += w.step_pns
            cs += w.step_cs
            dcs += w.step_dcs
    gamma = max(w.step_gamma for w in ranks)
    drafted = rf.draft_time(plain.roofline, pns, cs, dcs, gamma)
    return rf.with_draft(cost, drafted), plain
