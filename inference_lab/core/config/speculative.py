"""Speculative decoding's configuration (``[speculative]``): the drafter, the draft
length, the acceptance rates.

Rule 1: a class is valid at construction or raises a FieldError naming the field: exactly
        one source of acceptance rates, per-position rates that never rise, a
        ``gamma_by_batch`` whose batch sizes ascend and whose draft lengths never rise.
Rule 2: a CSV of measured rounds (``acceptance_file``) is read by the loader
        (:func:`~inference_lab.core.config.loading.load_acceptance_rounds`), never here.
"""

from __future__ import annotations

import attrs

from inference_lab.core.config.checks import ge, gt, le, one_of, optional_nonempty
from inference_lab.core.config.model import KV_LAYERS, Layer, WeightStream
from inference_lab.validation import FieldError

__all__ = [
    "DRAFTER_KINDS",
    "MAX_SPECULATIVE_TOKENS",
    "DraftWeightStream",
    "DrafterConfig",
    "SpeculativeConfig",
    "check_acceptance_rates",
]


@attrs.frozen(kw_only=True)
class DraftWeightStream(WeightStream):
    """A drafter's weight stream: as a model's, except that ``resident_params`` counts
    only what the drafter adds to HBM. A drafter that reuses the target's embedding and
    lm_head reads them (``active_params``) without holding them a second time."""

    resident_params: float = attrs.field(validator=ge(0))


#: How a drafter's work is priced (``docs/configuration.md#speculative``).
DRAFTER_KINDS = ("fraction", "model", "mtp")
#: The most draft tokens per step a config may ask for.
MAX_SPECULATIVE_TOKENS = 16


@attrs.frozen(kw_only=True)
class DrafterConfig:
    """``[speculative.drafter]``: what proposing the draft tokens costs.

    ``fraction``: each of a step's draft tokens costs ``fraction`` of the target's step over
    the same batch without drafts. ``model`` (a small draft model, EAGLE heads) and ``mtp``
    (the target's own multi-token-prediction layers): ``weights`` and ``layers`` priced by
    the roofline, one pass per draft token. Their weights add to the replica's resident
    weights and their KV layers to every KV block."""

    kind: str = attrs.field(validator=one_of(DRAFTER_KINDS))
    fraction: float | None = attrs.field(default=None, validator=[gt(0), le(1)])
    weights: tuple[DraftWeightStream, ...] = ()
    layers: tuple[Layer, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.kind == "fraction":
            if self.fraction is None:
                raise FieldError("fraction", "is required when kind = fraction")
            if self.weights or self.layers:
                raise FieldError("weights", "applies to kind model or mtp, not fraction")
            return
        if self.fraction is not None:
            raise FieldError("fraction", f"applies to kind fraction, not {self.kind}")
        if not self.weights:
            raise FieldError("weights", f"kind {self.kind} needs at least one weight stream")
        for i, w in enumerate(self.weights):
            if w.routing is not None and w.resident_params < w.active_params:
                raise FieldError(
                    "weights",
                    f"[{i}]: a routed stream's resident_params must be >= active_params",
                )
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, KV_LAYERS) or layer.window != 0:
                raise FieldError(
                    "layers", f"[{i}]: a drafter's layers must be full-context attention or mla"
                )


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """``[speculative]``: speculative decoding (off without the table).

    Each decode step of a sequence verifies ``num_speculative_tokens`` (gamma) draft tokens:
    it computes ``1 + gamma`` positions and advances by ``1 + accepted``. How many are
    accepted is drawn from the engine's own generator (seeded by ``seed``) with one of:
    a constant per-token rate ``acceptance_rate`` (alpha: position ``j`` is accepted with
    probability alpha^j), per-position rates ``acceptance_rates`` (vLLM's per-position
    acceptance rates: the share of drafts whose position ``j`` was accepted), or
    ``acceptance_file``, a CSV of measured rounds (one accepted count per line), read by
    the loader. ``gamma_by_batch`` lowers gamma as the batch grows: ``[[seqs, gamma],
    ...]``, ascending; from ``seqs`` running sequences on, ``gamma`` draft tokens."""

    method: str = attrs.field(default="eagle", validator=attrs.validators.min_len(1))
    num_speculative_tokens: int = attrs.field(validator=[ge(1), le(MAX_SPECULATIVE_TOKENS)])
    acceptance_rate: float | None = attrs.field(default=None, validator=[ge(0), le(1)])
    acceptance_rates: tuple[float, ...] | None = None
    acceptance_file: str | None = attrs.field(default=None, validator=optional_nonempty)
    seed: int = attrs.field(default=0, validator=ge(0))
    gamma_by_batch: tuple[tuple[int, int], ...] = ()
    drafter: DrafterConfig

    def __attrs_post_init__(self) -> None:
        given = [
            name
            for name in ("acceptance_rate", "acceptance_rates", "acceptance_file")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise FieldError(
                "acceptance_rate",
                "set exactly one of acceptance_rate, acceptance_rates, acceptance_file"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        gamma = self.num_speculative_tokens
        rates = self.acceptance_rates
        if rates is not None:
            if len(rates) != gamma:
                raise FieldError(
                    "acceptance_rates",
                    f"must have num_speculative_tokens = {gamma} entries, got {len(rates)}",
                )
            check_acceptance_rates(rates, "acceptance_rates")
        last_seqs, last_gamma = 0, gamma
        for i, pair in enumerate(self.gamma_by_batch):
            if len(pair) != 2:
                raise FieldError("gamma_by_batch", f"[{i}]: must be a pair [seqs, gamma]")
            seqs, g = pair
            if seqs <= last_seqs:
                raise FieldError("gamma_by_batch", f"[{i}]: seqs must ascend from 1, got {seqs}")
            if not 0 <= g <= last_gamma:
                raise FieldError(
                    "gamma_by_batch",
                    f"[{i}]: gamma must be in 0..{last_gamma} (never rising), got {g}",
                )
            last_seqs, last_gamma = seqs, g

    def rates(self) -> tuple[float, ...]:
        """The per-position acceptance rates of ``acceptance_rate`` or
        ``acceptance_rates`` (a CSV's are the loader's: ``Deployment.acceptance_rates``)."""
        if self.acceptance_rates is not None:
            return tuple(self.acceptance_rates)
        if self.acceptance_rate is not None:
            alpha = self.acceptance_rate
            return tuple(alpha**j for j in range(1, self.num_speculative_tokens + 1))
        return ()

    def gamma_for(self, seqs: int) -> int:
        """The draft length for a batch of ``seqs`` running sequences (``gamma_by_batch``)."""
        gamma = self.num_speculative_tokens
        for at, g in self.gamma_by_batch:
            if seqs < at:
                break
            gamma = g
        return gamma


def check_acceptance_rates(rates: tuple[float, ...], field: str) -> None:
    """Per-position acceptance rates are shares (0..1) that never rise: a draft whose
    position ``j`` was accepted had every earlier position accepted."""
    last = 1.0
    for j, rate in enumerate(rates):
        if not 0.0 <= rate <= last:
            raise FieldError(
                field, f"[{j}]: must be in 0..{last:g} (per-position rates never rise), got {rate}"
            )
        last = rate
