"""KV events on the wire, in vLLM's layout, and where their endpoints expose them.

The payload of every KV-event message is what vLLM's own declarations
(``vllm/distributed/kv_events.py``) encode with msgspec, as of vLLM :data:`VLLM_RELEASE`
(commit :data:`VLLM_COMMIT`): the batch ``EventBatch`` is a positional array
(``array_like``), each event a map tagged by ``type`` (vLLM dropped ``array_like`` from
the events), fields equal to their declared default left out (``omit_defaults``).
``tests/test_serve_kv_events.py`` decodes every batch with structs that mirror those
declarations and re-encodes it to the same bytes.

Rule 1: a batch is ``[ts, [event, ...], data_parallel_rank]``: ``ts`` Unix seconds (a
        float), the rank always present (vLLM's publisher fills in its own).
Rule 2: ``BlockStored`` carries, in vLLM's order, ``block_hashes``,
        ``parent_block_hash`` (None at a chain's start), ``token_ids``, ``block_size``,
        ``lora_id`` (None), ``medium`` ("GPU"; "CPU" or "DISK" for a KV tier behind HBM:
        docs/kv-tiers.md), ``lora_name`` (None) -- declared without
        a default, so always present -- then the defaulted fields vLLM sets for a plain
        text request on one KV-cache group: ``extra_keys`` (one None per block),
        ``group_idx`` (0), ``kv_cache_spec_kind`` ("mla_attention" for a model whose
        full-context layers are MLA, else "full_attention"). ``kv_cache_spec_sliding_window``,
        ``locality``, ``ownership``, ``session_id`` and ``lookahead_token_ids`` are None
        in such an event, so vLLM leaves them out, and so do we.
Rule 3: ``BlockRemoved`` is ``block_hashes``, ``medium``, ``group_idx`` (0);
        ``AllBlocksCleared`` has no field.
Rule 4: without token ids (``--kv-events-no-token-ids``) a ``BlockStored`` still carries
        ``token_ids`` (vLLM declares it without a default: a decoder needs it), empty.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

from inference_lab.core.config import KV_LAYERS, Deployment, MLALayer

__all__ = [
    "MEDIUM_GPU",
    "VLLM_COMMIT",
    "VLLM_RELEASE",
    "batch",
    "cleared",
    "exposed_endpoints",
    "removed",
    "spec_kind",
    "stored",
]

#: The vLLM release whose declarations this layout follows, and its commit.
VLLM_RELEASE = "0.34.0"
VLLM_COMMIT = "62d4bc3c7"
#: vLLM's ``MEDIUM_GPU``: where the blocks are.
MEDIUM_GPU = "GPU"
_GROUP = 0


def spec_kind(deployment: Deployment) -> str:
    """vLLM's ``KVCacheSpecKind`` value for the deployment's one KV-cache group (the
    full-context layers the prefix cache stands for): MLA or full attention."""
    full = [
        layer
        for layer in deployment.model.layers
        if isinstance(layer, KV_LAYERS) and layer.window == 0
    ]
    return "mla_attention" if full and isinstance(full[0], MLALayer) else "full_attention"


def stored(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: list[int],
    block_size: int,
    kind: str,
    medium: str = MEDIUM_GPU,
) -> dict[str, Any]:
    """A ``BlockStored`` event (Rules 2 and 4); ``medium`` where the blocks are (a KV tier
    behind HBM: "CPU", "DISK")."""
    return {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent_block_hash,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": [None] * len(block_hashes),
        "group_idx": _GROUP,
        "kv_cache_spec_kind": kind,
    }


def removed(block_hashes: Sequence[int], medium: str = MEDIUM_GPU) -> dict[str, Any]:
    """A ``BlockRemoved`` event (Rule 3) from ``medium``."""
    return {
        "type": "BlockRemoved",
        "block_hashes": list(block_hashes),
        "medium": medium,
        "group_idx": _GROUP,
    }


def cleared() -> dict[str, Any]:
    """An ``AllBlocksCleared`` event (Rule 3)."""
    return {"type": "AllBlocksCleared"}


def batch(ts: float, events: list[dict[str, Any]], rank: int) -> list[Any]:
    """An ``EventBatch`` (Rule 1), ready for msgpack."""
    return [ts, events, rank]


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or an interface: it may be reachable from elsewhere


def exposed_endpoints(endpoint: str, replay_endpoint: str | None, bound: bool) -> list[str]:
    """The TCP endpoints among these that the server binds on an address other clients
    may reach (``*``, ``0.0.0.0``, ``::``, a name or a non-loopback address): the PUB
    endpoint when ``bound`` (vLLM's bind-or-connect rule), the replay endpoint always (a
    ROUTER is always bound). Called for the start-up warnings."""
    out = []
    for value, binds in ((endpoint, bound), (replay_endpoint, True)):
        if value is None or not binds or not value.startswith("tcp://"):
            continue
        host = value[len("tcp://") :].rpartition(":")[0]
        if not _loopback(host):
            out.append(value)
    return out
