"""A trace's requests as arrivals, each at its time.

Rule 1: block hashes are made only when the caller gives a block size (the deployment
        caches prefixes): from a request's ``hash_ids`` (Mooncake) or its prompt tokens
        (OpenAI batch).
"""

from __future__ import annotations

from inference_lab.traffic.hashing import token_block_hashes, trace_block_hashes
from inference_lab.traffic.traces import MOONCAKE_BLOCK, Trace
from inference_lab.workload.arrivals import Arrival, ArrivalGenerator

__all__ = ["TraceGenerator"]


class TraceGenerator(ArrivalGenerator):
    """A trace's requests, each at its time (Rule 6 for their hashes)."""

    def __init__(self, trace: Trace, block_size: int | None) -> None:
        self._trace = trace
        self._block_size = block_size
        self.has_content = trace.has_content
        self.total = len(trace.requests)

    def initial(self) -> list[Arrival]:
        bs = self._block_size
        out = []
        for r in self._trace.requests:
            hashes: tuple[int, ...] = ()
            if bs is not None:
                if r.hash_ids:
                    hashes = trace_block_hashes(r.hash_ids, r.input_tokens, bs, MOONCAKE_BLOCK)
                elif r.tokens:
                    hashes = token_block_hashes(r.tokens, bs)
            out.append(Arrival(r.time, r.input_tokens, r.output_tokens, -1, hashes, n=r.n))
        return out
