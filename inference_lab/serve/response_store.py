"""The stored responses of ``/v1/responses`` (``store``, ``previous_response_id``).

Rule 1: bounded: at most :data:`MAX_RESPONSES` responses and :data:`MAX_BYTES` of what
        they hold (:attr:`StoredResponse.size`: the body and every message whole, function
        call arguments, tool outputs and input items included); adding past either bound
        evicts the least recently used first.
Rule 2: in memory, per app: a restart forgets everything, and so does a server process
        that is not the one that answered (one hypercorn worker per server).
Rule 3: a stored response keeps its body (``GET /v1/responses/{id}``) and its
        conversation as chat messages, which a follow-up's prompt is counted over.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from inference_lab.api.tokenizer import ChatMessage
from inference_lab.jsonbytes import dumps

__all__ = ["MAX_BYTES", "MAX_RESPONSES", "ResponseStore", "StoredResponse"]

#: Responses kept at most.
MAX_RESPONSES = 1024
#: Bytes of stored bodies and conversations kept at most (:attr:`StoredResponse.size`).
MAX_BYTES = 64 * 1024 * 1024
#: What one stored message costs besides its JSON (the tuple, the strings' headers).
MESSAGE_OVERHEAD = 64


def _size(item: StoredResponse) -> int:
    """The body's bytes plus each message as compact JSON (role, content, tool calls with
    their arguments, name, tool call id) and :data:`MESSAGE_OVERHEAD`: every string the
    item keeps is counted at least at its UTF-8 length."""
    return len(item.body) + sum(len(dumps(tuple(m))) + MESSAGE_OVERHEAD for m in item.messages)


@attrs.frozen(kw_only=True)
class StoredResponse:
    body: bytes
    messages: tuple[ChatMessage, ...]
    #: Bytes counted against :data:`MAX_BYTES` (Rule 1), computed once.
    size: int = attrs.field(init=False, default=attrs.Factory(_size, takes_self=True))


class ResponseStore:
    """Stored responses by id, least recently used first (Rules 1-3)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        #: Responses evicted so far.
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        """What the stored responses hold, as counted against ``max_bytes``."""
        return self._bytes

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        """Keep ``item`` (not at all if it alone passes the byte bound)."""
        self.delete(response_id)
        if item.size > self.max_bytes:
            return
        self._items[response_id] = item
        self._bytes += item.size
        while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.size
            self.evicted += 1

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self._bytes -= item.size
        return True
