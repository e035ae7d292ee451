"""vLLM's ``kv_transfer_params`` on a completion request and its answer.

The fields are those of vLLM's NixlConnector and the proxies in front of it (vLLM's toy
proxy, llm-d's routing sidecar): the proxy sends the prefill server the request with
``max_tokens: 1``, ``stream: false`` and ``{"do_remote_decode": true, ...null fields}``;
the prefill server's answer carries ``{"do_remote_prefill": true, "remote_engine_id",
"remote_request_id", "remote_block_ids", "remote_host", "remote_port", "tp_size", ...}``
(:func:`remote_prefill_params`), which the proxy sends the decode server with the
original request. ``docs/disaggregation.md`` ("In serve") says how ``serve`` uses them.

Rule 1: the params are read by the strict converter (:mod:`inference_lab.api.schema`):
        no coercion, and every failure is a 400 whose ``param`` names the field
        (``kv_transfer_params.remote_port``). Absent, null, or with neither flag true,
        the request asks for no transfer (vLLM's connector then does nothing either).
Rule 2: a decode request's params must name everything a pull needs (engine, request,
        block ids, host, port); its block ids must be as many as its prompt fills blocks
        (:func:`check_blocks`): the prefill held exactly those.
Rule 3: the KV a decode server receives is the prompt's full blocks short of its last
        position (:func:`~inference_lab.core.engine.handoff.remote_positions`): the
        partial last block and the last position are computed where it decodes, as the
        engine's own hand-off does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from inference_lab.api.schema import expect, in_range, invalid_value, structure
from inference_lab.jsonbytes import dumps
from inference_lab.validation import Invalid

__all__ = [
    "FIELD",
    "ClaimBody",
    "ReleaseBody",
    "MAX_ID_CHARS",
    "RemoteDecode",
    "RemotePrefill",
    "check_blocks",
    "claim_body",
    "release_body",
    "parse_kv_transfer_params",
    "prompt_blocks",
    "remote_prefill_params",
    "with_field",
]

#: The request and answer field.
FIELD = "kv_transfer_params"
#: Engine and request ids, and host names, are at most this many characters.
MAX_ID_CHARS = 256


def _text(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not 0 < len(value) <= MAX_ID_CHARS:
        raise Invalid(f"a string of 1..{MAX_ID_CHARS} characters", value, attr.name)


def _block_ids(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and any(b < 0 for b in value):
        raise Invalid("an array of block ids (integers >= 0)", value, attr.name)


@attrs.frozen(kw_only=True)
class _Params:
    """The fields read (others, such as vLLM's newer ``dcp_size``, are ignored)."""

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    remote_engine_id: str | None = attrs.field(default=None, validator=_text)
    remote_request_id: str | None = attrs.field(default=None, validator=_text)
    remote_block_ids: list[int] | None = attrs.field(
        default=None,
        validator=_block_ids,
        metadata=expect("an array of block ids (integers >= 0)"),
    )
    remote_host: str | None = attrs.field(default=None, validator=_text)
    remote_port: int | None = attrs.field(default=None, validator=in_range(1, 65535))
    tp_size: int | None = attrs.field(default=None, validator=in_range(1))
    remote_num_tokens: int | None = attrs.field(default=None, validator=in_range(0))


@attrs.frozen(kw_only=True)
class _Body:
    kv_transfer_params: _Params | None = None


@attrs.frozen
class RemoteDecode:
    """``do_remote_decode``: a prefill server's request, whose KV it holds for a decode
    server once it finishes."""


@attrs.frozen(kw_only=True)
class RemotePrefill:
    """``do_remote_prefill``: a decode server's request, whose prompt's KV a prefill
    server holds: where (``host``, ``port``), whose (``engine_id``, ``request_id``) and
    which blocks."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    tp_size: int | None = None
    num_tokens: int | None = None


def parse_kv_transfer_params(raw: Mapping[str, Any]) -> RemoteDecode | RemotePrefill | None:
    """The transfer a request body asks for (Rules 1-2), or None for none. Raises
    :class:`~inference_lab.errors.ApiError` 400 naming the field."""
    value = raw.get(FIELD)
    if value is None:
        return None
    params: _Params | None = structure({FIELD: value}, _Body).kv_transfer_params
    if params is None:
        return None
    if params.do_remote_decode and params.do_remote_prefill:
        raise invalid_value(
            f"{FIELD}.do_remote_prefill",
            f"{FIELD}: do_remote_decode and do_remote_prefill cannot both be true",
        )
    if params.do_remote_decode:
        return RemoteDecode()
    if not params.do_remote_prefill:
        return None
    missing = [
        name
        for name in (
            "remote_engine_id",
            "remote_request_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
        )
        if getattr(params, name) is None
    ]
    if missing:
        raise invalid_value(
            f"{FIELD}.{missing[0]}",
            f"{FIELD}.{missing[0]} is required with do_remote_prefill (the prefill server's "
            "answer carries it)",
        )
    assert params.remote_engine_id is not None and params.remote_request_id is not None
    assert params.remote_block_ids is not None and params.remote_host is not None
    assert params.remote_port is not None
    return RemotePrefill(
        engine_id=params.remote_engine_id,
        request_id=params.remote_request_id,
        block_ids=tuple(params.remote_block_ids),
        host=params.remote_host,
        port=params.remote_port,
        tp_size=params.tp_size,
        num_tokens=params.remote_num_tokens,
    )


@attrs.frozen(kw_only=True)
class ReleaseBody:
    """``POST /kv_transfer/release`` on a prefill server: the KV a decode server pulled
    (or gave up), named as its params named it."""

    remote_engine_id: str = attrs.field(validator=_text)
    remote_request_id: str = attrs.field(validator=_text)


@attrs.frozen(kw_only=True)
class ClaimBody(ReleaseBody):
    """``POST /kv_transfer/claim`` on a prefill server: a decode server about to admit a
    request checks that the KV its params name is held there, for its model and its
    prompt's length."""

    remote_block_ids: list[int] = attrs.field(
        validator=_block_ids, metadata=expect("an array of block ids (integers >= 0)")
    )
    model: str = attrs.field(validator=_text)
    prompt_tokens: int = attrs.field(validator=in_range(1))


def claim_body(params: RemotePrefill, model: str, prompt_tokens: int) -> bytes:
    """The JSON a decode server sends to claim the KV ``params`` name."""
    return dumps(
        {
            "remote_engine_id": params.engine_id,
            "remote_request_id": params.request_id,
            "remote_block_ids": list(params.block_ids),
            "model": model,
            "prompt_tokens": prompt_tokens,
        }
    )


def release_body(params: RemotePrefill) -> bytes:
    """The JSON a decode server sends once it pulled the KV ``params`` name."""
    return dumps({"remote_engine_id": params.engine_id, "remote_request_id": params.request_id})


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """The KV blocks a prompt of ``prompt_tokens`` fills (its last one maybe partly): what
    a prefill holds for it and names in ``remote_block_ids``."""
    return -(-prompt_tokens // block_size)


def check_blocks(params: RemotePrefill, prompt_tokens: int, block_size: int) -> None:
    """Rule 2: a 400 unless ``params`` name as many blocks as the prompt fills."""
    want = prompt_blocks(prompt_tokens, block_size)
    got = len(params.block_ids)
    if got != want:
        raise invalid_value(
            f"{FIELD}.remote_block_ids",
            f"{FIELD}.remote_block_ids names {got} blocks, but this request's prompt of "
            f"{prompt_tokens} tokens fills {want} blocks of {block_size} tokens: the params "
            "belong to another prompt",
        )


def remote_prefill_params(
    *,
    engine_id: str,
    request_id: str,
    block_ids: tuple[int, ...],
    host: str,
    port: int,
    tp_size: int,
    num_tokens: int,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill server's answer, in the order vLLM's
    NixlConnector writes them (``request_finished``), with its newer ``remote_num_tokens``
    (the positions the prefill computed)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(block_ids),
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_num_tokens": num_tokens,
    }


def with_field(body: bytes, key: str, value: Any) -> bytes:
    """A compact JSON object's bytes (``{...}``) with ``key: value`` added last: how an
    answer, whichever builder wrote it, gets its ``kv_transfer_params``."""
    if not body.endswith(b"}"):
        raise ValueError("not a JSON object")
    sep = b"" if body == b"{}" else b","
    return body[:-1] + sep + dumps(key) + b":" + dumps(value) + b"}"
