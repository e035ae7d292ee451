"""The engine: a pure discrete-event simulation of one deployment's scheduling.

The engine's public interface is :class:`Engine` with the h11 shape (``submit``,
``abort``, ``next_event_time``, ``step``, ``statistics``) and the frozen values it takes
and gives (:class:`RequestSpec`, :class:`StepEvents`, :class:`Finished`, ...), re-exported
here. The package's modules are its seams, after vLLM v1's ``core/``:

- ``engine``: the deployment, the event loop's one step, the late-join rule;
- ``request``: a request, its status and its progress arithmetic;
- ``wait_queue``: the waiting queue and its policies;
- ``scheduler``: one worker's scheduler (the per-request loop) and ``fast_path`` with
  ``running_rows``: its other way in, for a loaded worker;
- ``kv_cache_manager`` and ``block_pool``: the KV cache, the only code that changes block
  counts;
- ``router``: which replica an arrival goes to;
- ``drafting``: speculative decoding's verify steps and the drafter's price;
- ``dp_group``: data-parallel attention ranks in lockstep;
- ``calendar``: the events in time order;
- ``outputs``: the frozen values the engine reports; ``scheduler_output``: a
  scheduler's batch for a step.
"""

from inference_lab.core.engine.block_pool import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from inference_lab.core.engine.engine import Engine
from inference_lab.core.engine.outputs import (
    EngineStatistics,
    Finished,
    QueueView,
    StepEvents,
    StepInfo,
    WorkerStatistics,
)
from inference_lab.core.engine.request import RequestSpec, RequestStatus
from inference_lab.core.engine.scheduler_output import SchedulerOutput
from inference_lab.core.engine.stepping import RunReport

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Engine",
    "EngineStatistics",
    "Finished",
    "KVEvent",
    "QueueView",
    "RequestSpec",
    "RequestStatus",
    "RunReport",
    "SchedulerOutput",
    "StepEvents",
    "StepInfo",
    "WorkerStatistics",
]
