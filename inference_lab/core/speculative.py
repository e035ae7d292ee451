"""Speculative decoding's acceptance draws: how many draft tokens a verify step accepts.

The engine (:mod:`inference_lab.core.engine`) asks once per drafting sequence per step;
the drafter's cost is the roofline's (:meth:`inference_lab.core.roofline.Roofline.draft_time`).

Rule 1: no global randomness: draws come from a ``numpy`` generator the sampler owns,
        seeded by the caller (``[speculative] seed``), so a run is a pure function of its
        inputs and its seed.
Rule 2: every acceptance model is a tuple of per-position rates ``r_1 >= r_2 >= ...``,
        ``r_j`` the probability that a draft's position ``j`` is accepted (vLLM's
        per-position acceptance rate): a constant rate alpha is ``alpha^j``; a CSV of
        measured rounds its empirical shares. One uniform ``u`` per draw accepts the
        positions ``j`` with ``u < r_j`` (a prefix, since the rates never rise), capped
        at the step's draft length.
Rule 3: a draw never exceeds the draft length it is asked for, so a sequence advances by
        at most ``1 + gamma`` positions per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np

__all__ = ["AcceptanceDraws", "FixedAcceptance", "RateAcceptance", "expected_length"]

#: Uniforms drawn from the generator at a time (one per draw is used).
_BLOCK = 4096


class AcceptanceDraws(Protocol):
    """What the engine asks: how many of ``gamma`` draft tokens one verify accepts."""

    def draw(self, gamma: int) -> int: ...


def expected_length(rates: Sequence[float], gamma: int) -> float:
    """The mean tokens a verify of ``gamma`` draft tokens emits: the bonus token plus the
    expected accepted drafts, ``1 + sum(r_1 .. r_gamma)`` (vLLM's mean acceptance length)."""
    return 1.0 + float(sum(rates[:gamma]))


class RateAcceptance:
    """Draws from per-position rates (Rule 2) with its own seeded generator (Rule 1)."""

    __slots__ = ("rates", "_rng", "_buffer", "_next")

    def __init__(self, rates: Sequence[float], seed: int) -> None:
        self.rates = tuple(float(r) for r in rates)
        self._rng = np.random.default_rng(seed)
        self._buffer: list[float] = []
        self._next = 0

    def draw(self, gamma: int) -> int:
        i = self._next
        if i >= len(self._buffer):
            self._buffer = self._rng.random(_BLOCK).tolist()
            i = 0
        self._next = i + 1
        u = self._buffer[i]
        rates = self.rates
        limit = gamma if gamma < len(rates) else len(rates)
        accepted = 0
        while accepted < limit and u < rates[accepted]:
            accepted += 1
        return accepted


class FixedAcceptance:
    """Replays a fixed sequence of accepted counts (each capped at the draft length asked
    for: Rule 3), then repeats it: a test's or a what-if's exact acceptance pattern."""

    __slots__ = ("_values", "_iter")

    def __init__(self, values: Iterable[int]) -> None:
        self._values = tuple(values)
        if not self._values or any(v < 0 for v in self._values):
            raise ValueError("FixedAcceptance needs at least one count, each >= 0")
        self._iter: Iterator[int] = iter(())

    def draw(self, gamma: int) -> int:
        try:
            value = next(self._iter)
        except StopIteration:
            self._iter = iter(self._values)
            value = next(self._iter)
        return value if value < gamma else gamma
