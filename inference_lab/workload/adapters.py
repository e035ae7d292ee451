"""Which LoRA adapter each request of a workload names (``[adapters]``, docs/lora.md).

Rule 1: the choice draws from its own generator, seeded by the run's seed and a constant,
        never from the workload's: a workload with ``[adapters]`` has exactly the arrivals,
        lengths and hashes it has without.
Rule 2: a session's turns, and a closed-loop user's requests, all name the adapter their
        first one drew (a conversation, an application, keeps its adapter); an open loop
        draws one per arrival, in arrival order.
Rule 3: the adapters must be the deployment's: ``zipf`` ranks the ``[lora]`` adapters in
        their order, ``weights`` may name only them (a ConfigError, one line, otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inference_lab.core.config import AdapterMix
from inference_lab.errors import ConfigError
from inference_lab.workload.arrivals import Arrival

__all__ = ["AdapterPicker"]

#: mixed into the run's seed for the adapter draws (Rule 1)
_STREAM = 0x10A


class AdapterPicker:
    """The adapters of a run's requests. Built by the simulator from the workload's
    ``[adapters]`` and the deployment's adapter names; None stands for the base model."""

    def __init__(self, mix: AdapterMix, served: Sequence[str], seed: int) -> None:
        if not served:
            raise ConfigError("adapters: the deployment serves no LoRA adapter ([lora])")
        if mix.weights is not None:
            unknown = [n for n in mix.weights if n not in served]
            if unknown:
                raise ConfigError(
                    f"adapters.weights.{unknown[0]}: not an adapter of the deployment "
                    f"(it serves {', '.join(served)})"
                )
            names = list(mix.weights)
            weights = np.array([mix.weights[n] for n in names], dtype=float)
        else:
            assert mix.zipf is not None
            names = list(served)
            weights = 1.0 / np.arange(1, len(names) + 1, dtype=float) ** mix.zipf
        probs = weights / weights.sum() * (1.0 - mix.base_share)
        #: the choices: each adapter, then the base model (None)
        self.choices: list[str | None] = [*names, None]
        self.probs = np.append(probs, mix.base_share)
        self.probs /= self.probs.sum()
        self._rng = np.random.default_rng([seed, _STREAM])
        self._by_key: dict[tuple[str, int], str | None] = {}
        #: requests that named each choice, in ``choices`` order
        self.counts = [0] * len(self.choices)

    def draws(self, count: int) -> list[str | None]:
        """The next ``count`` choices, one per arrival (an open loop's, Rule 2)."""
        picks = self._rng.choice(len(self.choices), size=count, p=self.probs)
        for i, n in enumerate(np.bincount(picks, minlength=len(self.choices)).tolist()):
            self.counts[i] += n
        choices = self.choices
        return [choices[i] for i in picks.tolist()]

    def pick(self, arrival: Arrival) -> str | None:
        """The adapter of ``arrival``: its session's or user's, else a fresh draw."""
        key = (
            ("session", arrival.session)
            if arrival.session >= 0
            else ("user", arrival.user)
            if arrival.user >= 0
            else None
        )
        if key is not None and key in self._by_key:
            choice = self._by_key[key]
            self.counts[self.choices.index(choice)] += 1
            return choice
        choice = self.draws(1)[0]
        if key is not None:
            self._by_key[key] = choice
        return choice

    def requests_by_adapter(self) -> dict[str, int]:
        """Requests that named each adapter (``base`` for the base model)."""
        return {
            ("base" if c is None else c): n
            for c, n in zip(self.choices, self.counts, strict=True)
            if n
        }
