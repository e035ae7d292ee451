"""The pacer's early wake: how long before a step's end the pacer wakes the engine task.

The pacer's timer and its hand-over to the engine task land a little after the deadline
on any real machine, and the step's computation takes a little longer, so a pacer that
woke exactly on time would release every step's tokens late. It wakes early instead, by
an amount learned from its own wake-ups.

Rule 1: the early wake stays within ``0 .. MAX_EARLY``.
Rule 2: each sample (how late a timer wake-up's step had been computed, its tokens ready
        to leave; negative when early) moves the early wake by an exponential average
        of gain :data:`EARLY_GAIN`; the first samples are averaged evenly (gain ``1/k``
        for the k-th), so a fresh runtime is calibrated after a few wake-ups.
Rule 3: a runtime may start from another's calibration on the same machine
        (:meth:`EarlyWake.adopt`) and keeps learning from there.
"""

from __future__ import annotations

import attrs

__all__ = ["EARLY_GAIN", "MAX_EARLY", "EarlyWake", "PacingCalibration"]

#: The pacer wakes the engine at most this many seconds before a step's end is due (a
#: timer's wake-up and a step's computation take a few tens of microseconds each; a
#: machine that stalls for longer must not teach the pacer to release tokens that early).
MAX_EARLY = 0.0005
#: The weight of each new sample once the first ``1 / EARLY_GAIN`` have been averaged.
EARLY_GAIN = 0.05


@attrs.frozen
class PacingCalibration:
    """How early the pacer wakes the engine task (seconds), and from how many timer
    wake-ups that was learned (0: not yet: ``early`` is 0)."""

    early: float = 0.0
    samples: int = 0


class EarlyWake:
    """The learned early wake of one runtime's pacer (see the module rules). ``early`` is
    read by the pacer and the engine task on every wake-up."""

    __slots__ = ("early", "samples")

    def __init__(self) -> None:
        self.early = 0.0
        self.samples = 0

    def learn(self, lateness: float) -> None:
        """Take one timer wake-up that found its step ``lateness`` seconds late (Rule 2)."""
        self.samples += 1
        gain = max(EARLY_GAIN, 1.0 / self.samples)
        early = self.early + gain * lateness
        self.early = min(MAX_EARLY, early) if early > 0.0 else 0.0

    def adopt(self, calibration: PacingCalibration) -> None:
        """Start from ``calibration`` (Rule 3), kept within bounds."""
        self.early = min(MAX_EARLY, max(0.0, calibration.early))
        self.samples = max(0, calibration.samples)

    def statistics(self) -> PacingCalibration:
        """What has been learned so far."""
        return PacingCalibration(self.early, self.samples)
