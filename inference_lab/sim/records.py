"""Compact records of a simulation: what `run_simulation` keeps per request and per step.

A million-request run reports a million `Finished` records and a few million steps; as
Python objects they would take gigabytes. These keep them as typed columns (8 bytes per
value) and give the objects back on demand.

Rule 1: a record read back is the one that was added, field for field and bit for bit:
        floats are stored as float64, integers as int64, the finish reason as one flag
        (`length` or `stop`, the only two the engine reports).
Rule 2: appending is constant work per record; reading a column is one array, in the order
        the records were added.
Rule 3: the step figures the summary averages are kept per step (its means are numpy's
        over the same values); the speculative totals are summed as the steps arrive, in
        their order, as `summary.speculative_summary` sums them.

Who uses it: `inference_lab.sim.run` (the loop appends; `SimResult` holds them), the
summary functions (columns) and the CSV writer (`inference_lab.sim.text`: records, one at
a time).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.engine import Finished, StepInfo
from inference_lab.workload.arrivals import Arrival

__all__ = ["QUEUE_LIMIT", "ArrivalTable", "FinishedTable", "Refused", "StepTotals"]

#: The `limit` of a request refused by the waiting-queue bound (``max_waiting``).
QUEUE_LIMIT = "max_waiting"

_FLOATS = ("arrival_time", "first_scheduled_time", "first_token_time", "finish_time")
_INTS = (
    "request_id",
    "prompt_tokens",
    "output_tokens",
    "preemptions",
    "n",
    "cached_tokens",
    "worker",
)


@attrs.frozen
class Refused:
    """A request the run refused: one the deployment can never run (`RequestRefused` from
    `Engine.submit`; `limit` names the bound) or one refused by ``max_waiting``
    (`limit` :data:`QUEUE_LIMIT`)."""

    arrival: Arrival
    limit: str
    reason: str


#: The columns of a disaggregated run's hand-offs (kept only for one: `disaggregated`).
_HANDOFF_FLOATS = ("prefill_end_time", "transfer_end_time", "transfer_bytes")


class FinishedTable(Sequence[Finished]):
    """Completed requests in completion order, as columns (Rule 1); a `Sequence` of
    `Finished` built when read. With `disaggregated`, the hand-off fields too (the
    prefill worker, the ends of the prefill and of the transfer, the bytes)."""

    def __init__(self, *, disaggregated: bool = False) -> None:
        self._floats: dict[str, array[float]] = {name: array("d") for name in _FLOATS}
        self._ints: dict[str, array[int]] = {name: array("q") for name in _INTS}
        self._length = array("b")  # 1: finish_reason "length", 0: "stop"
        fl, it = self._floats, self._ints
        #: the columns' appends, in the order `extend` takes a record's fields
        self._appends: tuple[Callable[[Any], None], ...] = (
            *(fl[name].append for name in _FLOATS),
            *(it[name].append for name in _INTS),
            self._length.append,
        )
        #: the hand-off columns (None: not a disaggregated run)
        self._handoffs: tuple[array[int], dict[str, array[float]]] | None = None
        if disaggregated:
            self._handoffs = (array("q"), {name: array("d") for name in _HANDOFF_FLOATS})

    @property
    def disaggregated(self) -> bool:
        return self._handoffs is not None

    def extend(self, records: Sequence[Finished]) -> None:
        """Append `records` (a step's completions)."""
        at, fst, ftt, fin, rid, prompt, out, pre, n, cached, worker, length = self._appends
        for f in records:
            at(f.arrival_time)
            fst(f.first_scheduled_time)
            ftt(f.first_token_time)
            fin(f.finish_time)
            rid(f.request_id)
            prompt(f.prompt_tokens)
            out(f.output_tokens)
            pre(f.preemptions)
            n(f.n)
            cached(f.cached_tokens)
            worker(f.worker)
            length(f.finish_reason == "length")
        if self._handoffs is not None:
            prefill, floats = self._handoffs
            for f in records:
                prefill.append(f.prefill_worker)
                floats["prefill_end_time"].append(f.prefill_end_time)
                floats["transfer_end_time"].append(f.transfer_end_time)
                floats["transfer_bytes"].append(f.transfer_bytes)

    def add_fields(self, f: tuple[Any, ...]) -> None:
        """Append one record given as the first twelve fields of its `Finished`, in their
        order (`Engine.run_until`'s ``record``; not for a disaggregated table)."""
        at, fst, ftt, fin, rid, prompt, out, pre, n, cached, worker, length = self._appends
        rid(f[0])
        prompt(f[1])
        out(f[2])
        length(f[3] == "length")
        at(f[4])
        fst(f[5])
        ftt(f[6])
        fin(f[7])
        pre(f[8])
        n(f[9])
        cached(f[10])
        worker(f[11])

    def clear(self) -> None:
        """Forget every record (the columns are emptied in place, so the appends stay
        bound); a sharded run's shard folds its records into sums and sketches, then
        clears them. No column view may be alive."""
        for floats in self._floats.values():
            del floats[:]
        for ints in self._ints.values():
            del ints[:]
        del self._length[:]

    def column(self, name: str) -> npt.NDArray[Any]:
        """One field of every record, in order: float64 for times, int64 for counts. A
        view of the column, not a copy: the table cannot grow while one is alive (the
        run takes them once it is over)."""
        if name in self._floats:
            return np.frombuffer(self._floats[name], dtype=np.float64)
        if self._handoffs is not None:
            if name == "prefill_worker":
                return np.frombuffer(self._handoffs[0], dtype=np.int64)
            if name in self._handoffs[1]:
                return np.frombuffer(self._handoffs[1][name], dtype=np.float64)
        return np.frombuffer(self._ints[name], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._length)

    def _record(self, i: int) -> Finished:
        fl = self._floats
        it = self._ints
        record = Finished(
            request_id=it["request_id"][i],
            prompt_tokens=it["prompt_tokens"][i],
            output_tokens=it["output_tokens"][i],
            finish_reason="length" if self._length[i] else "stop",
            arrival_time=fl["arrival_time"][i],
            first_scheduled_time=fl["first_scheduled_time"][i],
            first_token_time=fl["first_token_time"][i],
            finish_time=fl["finish_time"][i],
            preemptions=it["preemptions"][i],
            n=it["n"][i],
            cached_tokens=it["cached_tokens"][i],
            worker=it["worker"][i],
        )
        if self._handoffs is None:
            return record
        prefill, floats = self._handoffs
        return attrs.evolve(
            record,
            prefill_worker=prefill[i],
            prefill_end_time=floats["prefill_end_time"][i],
            transfer_end_time=floats["transfer_end_time"][i],
            transfer_bytes=floats["transfer_bytes"][i],
        )

    @overload
    def __getitem__(self, index: int) -> Finished: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Finished]: ...
    def __getitem__(self, index: int | slice) -> Finished | Sequence[Finished]:
        if isinstance(index, slice):
            return [self._record(i) for i in range(*index.indices(len(self)))]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("FinishedTable index out of range")
        return self._record(index)

    def __iter__(self) -> Iterator[Finished]:
        return (self._record(i) for i in range(len(self)))


class StepTotals:
    """The steps of a run as the summary needs them (Rule 3): per step its KV usage and its
    FLOP and bandwidth utilisations; the preemptions summed; with `speculative`, the
    speculative counters and times summed."""

    def __init__(self, speculative: bool = False) -> None:
        self.kv_usage = array("d")
        self.flop_util = array("d")
        self.bw_util = array("d")
        self.preempted = 0
        self.speculative = speculative
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.time_s = 0.0
        self.plain_time_s = 0.0
        self._kv_append = self.kv_usage.append
        self._flop_append = self.flop_util.append
        self._bw_append = self.bw_util.append

    def add(self, s: StepInfo) -> None:
        self._kv_append(s.kv_usage)
        self._flop_append(s.flop_util)
        self._bw_append(s.bw_util)
        if s.preempted:
            self.preempted += s.preempted
        if self.speculative:
            self.time_s += s.duration
            d = s.drafts
            if d:
                self.drafts += d
                self.draft_tokens += s.draft_tokens
                self.accepted_tokens += s.accepted_tokens
                self.plain_time_s += s.plain_duration
            else:
                self.plain_time_s += s.duration

    def __len__(self) -> int:
        return len(self.kv_usage)

    def clear(self) -> None:
        """Forget the per-step figures, in place (the preemptions and the speculative sums
        are kept): a shard of a sharded run folds them into sums first. No column view
        may be alive."""
        for column in (self.kv_usage, self.flop_util, self.bw_util):
            del column[:]

    def column(self, name: str) -> npt.NDArray[np.float64]:
        """``kv_usage``, ``flop_util`` or ``bw_util`` of every step, in order."""
        values: array[float] = getattr(self, name)
        return np.frombuffer(values, dtype=np.float64)


class ArrivalTable(Mapping[int, Arrival]):
    """Request id -> its `Arrival`, for an open loop fed from arrays: the requests were
    submitted in arrival order, so ids ``first, first + 1, ...`` map to positions in the
    arrays (a refused arrival takes no id); `pop` removes one (refused by
    ``max_waiting``)."""

    def __init__(
        self,
        times: npt.NDArray[np.float64],
        prompts: npt.NDArray[np.int64],
        outputs: npt.NDArray[np.int64],
    ) -> None:
        self._times = times
        self._prompts = prompts
        self._outputs = outputs
        self._index = array("q")  # position of request id first + i; -1: removed
        self._first = 0
        self._count = 0

    def arrival(self, i: int) -> Arrival:
        """The arrival at position ``i`` of the arrays."""
        return Arrival(float(self._times[i]), int(self._prompts[i]), int(self._outputs[i]))

    def add(self, request_id: int, i: int) -> None:
        """Request ``request_id`` is the arrival at position ``i`` (ids come in order)."""
        if not self._index:
            self._first = request_id
        assert request_id == self._first + len(self._index)
        self._index.append(i)
        self._count += 1

    def _position(self, request_id: int) -> int:
        k = request_id - self._first
        if 0 <= k < len(self._index):
            return self._index[k]
        return -1

    def __getitem__(self, request_id: int) -> Arrival:
        i = self._position(request_id)
        if i < 0:
            raise KeyError(request_id)
        return self.arrival(i)

    def pop(self, request_id: int) -> Arrival:
        """Remove ``request_id`` and return its arrival (KeyError if absent)."""
        a = self[request_id]
        self._index[request_id - self._first] = -1
        self._count -= 1
        return a

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, int) and self._position(request_id) >= 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        first = self._first
        return (first + k for k, i in enumerate(self._index) if i >= 0)
