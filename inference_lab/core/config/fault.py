"""The test harness's fault directive (``[fault]``, ``x-inference-lab-fault``).

It belongs to the serve test harness (``docs/test-harness.md``) and is read only there,
but a model config's ``[fault]`` table is validated by the config loader with the rest
of the file (a config is valid as a whole or not at all), so the class lives with the
config, below the serve layer that uses it.

Rule 1: a directive is valid at construction or raises a FieldError naming the field;
        ``after_chunks`` and ``delay_ms`` are bounded (:data:`MAX_FAULT_CHUNKS`,
        :data:`MAX_FAULT_DELAY_MS`).
"""

from __future__ import annotations

import attrs

from inference_lab.core.config.checks import ge, le, one_of
from inference_lab.validation import FieldError

__all__ = ["FAULT_MODES", "MAX_FAULT_CHUNKS", "MAX_FAULT_DELAY_MS", "FaultConfig"]

#: The stream endings a fault can inject.
FAULT_MODES = (
    "cut_between_frames",
    "cut_mid_frame",
    "reset",
    "stall",
    "error_envelope_200",
    "error_400_in_sse",
    "no_done",
    "no_usage",
    "cancelled_499",
    "mid_reasoning",
    "mid_tool_call",
)
#: Bounds of ``after_chunks`` and ``delay_ms``: far above any useful test, far below a
#: stream that never ends.
MAX_FAULT_CHUNKS = 100_000
MAX_FAULT_DELAY_MS = 600_000


@attrs.frozen(kw_only=True)
class FaultConfig:
    """A fault directive: a model config's ``[fault]`` table, or one request's
    ``x-inference-lab-fault`` header (parsed by :mod:`inference_lab.serve.harness.directives`).

    ``after_chunks`` content frames (``delay_ms`` apart; with ``paced``, the engine's
    tokens as the model paces them) come before the ``mode``'s ending; ``utf8`` (only for
    ``cut_mid_frame``) puts the cut inside a multi-byte character. ``rate`` is the share
    of the model's streaming requests a ``[fault]`` table applies to (a header: 1).
    """

    mode: str = attrs.field(validator=one_of(FAULT_MODES))
    after_chunks: int = attrs.field(default=3, validator=[ge(0), le(MAX_FAULT_CHUNKS)])
    delay_ms: int = attrs.field(default=10, validator=[ge(0), le(MAX_FAULT_DELAY_MS)])
    utf8: bool = False
    paced: bool = False
    rate: float = attrs.field(default=1.0, validator=[ge(0), le(1)])

    def __attrs_post_init__(self) -> None:
        if self.utf8 and self.mode != "cut_mid_frame":
            raise FieldError("utf8", f"applies to mode cut_mid_frame only, got mode {self.mode}")
