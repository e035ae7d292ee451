"""The harness of one app: what answers a completion request instead of the normal path.

Rule 1: off by default (``--enable-test-harness``, ``INFERENCE_LAB_ENABLE_TEST_HARNESS``).
        Off, the fault header is a 400 and a scripted marker is ordinary prompt text;
        only a model's own ``[fault]`` table applies, since the operator wrote it, not a
        client.
Rule 2: :meth:`Harness.intercept` runs after the model check (an unknown model is a 404
        first) and before fit and admission. The header wins over a scripted marker,
        which wins over the model's ``[fault]`` table (drawn at its ``rate`` from a
        generator seeded by ``--seed``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from inference_lab.api.requests import ParsedRequest
from inference_lab.core.config import FaultConfig
from inference_lab.serve.exchange import Exchange
from inference_lab.serve.harness.answers import Fault, Intercepted, Scripted
from inference_lab.serve.harness.directives import (
    FAULT_HEADER,
    find_script,
    invalid_directive,
    parse_fault_header,
)

__all__ = ["Harness"]


@attrs.define
class _TableFault:
    """A model's ``[fault]`` table and the generator its rate is drawn from."""

    fault: FaultConfig
    rng: random.Random

    def draw(self) -> bool:
        rate = self.fault.rate
        if rate >= 1.0:
            return True
        return rate > 0.0 and self.rng.random() < rate


class Harness:
    """The test harness of one app (see the module rules). Built by ``ServeState.build``;
    :meth:`intercept` is called by the completion route for every request."""

    def __init__(
        self, *, enabled: bool, faults: Sequence[tuple[str, FaultConfig]] = (), seed: int = 0
    ) -> None:
        self.enabled = enabled
        self._tables = {
            name: _TableFault(fault, random.Random(f"{seed}:{name}")) for name, fault in faults
        }
        #: Anything to look at beyond the header (cheap test on the hot path).
        self._active = enabled or bool(self._tables)

    def passes(self, exchange: Exchange) -> bool:
        """Whether :meth:`intercept` surely lets this request go its normal way, without
        drawing a table's fault: no fault header, and nothing enabled or configured."""
        return not self._active and exchange.header(FAULT_HEADER) is None

    def intercept(
        self, exchange: Exchange, raw: Mapping[str, Any], parsed: ParsedRequest
    ) -> Intercepted | None:
        """What answers this (validated, known-model) request instead of the normal path,
        or None. Raises :class:`ApiError` 400 ``invalid_fault_directive`` for a fault
        header with the harness off, on a non-streaming request, or malformed."""
        header = exchange.header(FAULT_HEADER)
        if header is not None:
            if not self.enabled:
                raise invalid_directive(
                    "the test harness is off (start the server with --enable-test-harness "
                    "or INFERENCE_LAB_ENABLE_TEST_HARNESS=1)"
                )
            fault = parse_fault_header(header)
            if not parsed.stream:
                raise invalid_directive(
                    "x-inference-lab-fault applies to streaming requests only", "stream"
                )
            return Fault(fault, parsed)
        if not self._active:
            return None
        if self.enabled and parsed.kind == "chat":
            script = find_script(raw)
            if script is not None:
                return Scripted(script, parsed)
        table = self._tables.get(parsed.model)
        if table is not None and parsed.stream and table.draw():
            return Fault(table.fault, parsed)
        return None
