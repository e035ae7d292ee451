"""A pure AIMD (additive increase, multiplicative decrease) concurrency controller.

The state machine behind ``inference-lab load --adaptive aimd``. It sees only outcomes
(``on_success``, ``on_overload``) and answers with the concurrency limit; it does no I/O and
keeps no clock, so every transition is a synchronous call the load generator makes between
two checkpoints, and a test can drive it directly.

Rule 1: the limit stays within ``[1, max_limit]``.
Rule 2: outcomes are counted in windows. A window ends after ``window`` successful
  completions. If no 529 arrived during it, the limit rises by 1 (additive increase).
Rule 3: the first 529 of a window multiplies the limit by ``backoff`` (rounded down, floor 1)
  and starts a new window; further 529s in that new window do not cut again (they are
  mostly requests sent before the cut) but do mark it, so it ends without an increase.
Rule 4: only 529 (``overloaded_error``) is an overload signal. 503, other errors,
  connection failures and time-outs are neither successes nor overloads: ``on_outcome``
  ignores them and nothing here changes.
"""

from __future__ import annotations

import attrs

__all__ = ["AIMDController", "AIMDStatistics"]


@attrs.frozen
class AIMDStatistics:
    """A snapshot of the controller, as returned by ``AIMDController.statistics()``."""

    limit: int
    """The concurrency limit now."""
    max_limit: int
    """The ceiling (``max_limit``)."""
    window: int
    """Successes per window."""
    backoff: float
    """The factor of a cut."""
    successes_in_window: int
    """Successes counted in the current window."""
    overloaded_in_window: bool
    """A 529 arrived in the current window (it ends without an increase)."""
    cut_in_window: bool
    """The current window began with a cut (further 529s in it do not cut again)."""
    increases: int
    """Additive increases so far."""
    decreases: int
    """Cuts that lowered the limit so far."""
    successes: int
    """Successful completions seen."""
    overloads: int
    """529s seen."""
    min_limit_seen: int
    """The lowest limit so far."""
    max_limit_seen: int
    """The highest limit so far."""


def _positive_int(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _backoff(_inst: object, _attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"backoff must be > 0 and < 1, got {value!r}")


@attrs.define(kw_only=True)
class AIMDController:
    """The limit and the current window's bookkeeping.

    ``initial`` is the starting limit (``--concurrency``, default 1), clamped into
    ``[1, max_limit]``. Both ``on_*`` methods return the (possibly unchanged) limit.
    """

    initial: int = attrs.field(default=1, validator=_positive_int)
    max_limit: int = attrs.field(default=1024, validator=_positive_int)
    window: int = attrs.field(default=8, validator=_positive_int)
    backoff: float = attrs.field(default=0.5, validator=_backoff)

    limit: int = attrs.field(init=False)
    _successes_in_window: int = attrs.field(init=False, default=0)
    _overloaded_in_window: bool = attrs.field(init=False, default=False)
    _cut_in_window: bool = attrs.field(init=False, default=False)
    _increases: int = attrs.field(init=False, default=0)
    _decreases: int = attrs.field(init=False, default=0)
    _successes: int = attrs.field(init=False, default=0)
    _overloads: int = attrs.field(init=False, default=0)
    _min_seen: int = attrs.field(init=False)
    _max_seen: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.limit = min(self.initial, self.max_limit)
        self._min_seen = self._max_seen = self.limit

    def on_outcome(self, outcome: str) -> int:
        """Route one finished attempt by its outcome (``load.OUTCOMES``): ``"ok"`` is a
        success, ``"overloaded"`` (HTTP 529) an overload, anything else — 503, other HTTP
        errors, stream errors, connection errors, time-outs — is ignored (Rule 4)."""
        if outcome == "ok":
            return self.on_success()
        if outcome == "overloaded":
            return self.on_overload()
        return self.limit

    def on_success(self) -> int:
        """Record one successful completion; may end the window and raise the limit."""
        self._successes += 1
        self._successes_in_window += 1
        if self._successes_in_window >= self.window:
            if not self._overloaded_in_window and self.limit < self.max_limit:
                self.limit += 1
                self._increases += 1
                self._max_seen = max(self._max_seen, self.limit)
            self._new_window()
        return self.limit

    def on_overload(self) -> int:
        """Record one 529; cuts the limit if this window has not been cut yet."""
        self._overloads += 1
        if self._cut_in_window:
            self._overloaded_in_window = True
            return self.limit
        new = max(1, int(self.limit * self.backoff))
        if new != self.limit:
            self._decreases += 1
        self.limit = new
        self._min_seen = min(self._min_seen, new)
        self._new_window()
        self._cut_in_window = True
        return self.limit

    def _new_window(self) -> None:
        self._successes_in_window = 0
        self._overloaded_in_window = False
        self._cut_in_window = False

    def statistics(self) -> AIMDStatistics:
        """A frozen snapshot; the load generator puts the last one in its result."""
        return AIMDStatistics(
            limit=self.limit,
            max_limit=self.max_limit,
            window=self.window,
            backoff=self.backoff,
            successes_in_window=self._successes_in_window,
            overloaded_in_window=self._overloaded_in_window,
            cut_in_window=self._cut_in_window,
            increases=self._increases,
            decreases=self._decreases,
            successes=self._successes,
            overloads=self._overloads,
            min_limit_seen=self._min_seen,
            max_limit_seen=self._max_seen,
        )
