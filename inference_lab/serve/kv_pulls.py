"""A decode server's pulls (``serve --role decode``): the KV a ``do_remote_prefill``
request names, claimed on its prefill server before the request is admitted and released
there once it has arrived.

The transfer itself is the engine's (``remote_positions``: the request waits RECEIVING
while the KV crosses the profile's link, priced and paced like a step); what this module
does is the conversation with the prefill server that NIXL's side channel and its
notification carry in vLLM (``serve/kv_holds.py`` is the other end).

Rule 1: a decode server contacts only the prefill servers its params may name: loopback
        hosts and those of ``--kv-peers``: a host named there, an address inside a
        network named there (``10.0.0.0/8``: a cluster's pod addresses), or any (``*``).
        Anything else is a 400 before any connection is made: a request body must not
        make the server reach an arbitrary address.
Rule 2: a claim is made before the request is admitted; the prefill server's refusal
        (400, 404) is this request's refusal with the same status, naming the prefill
        server, and a prefill server that cannot be reached or answers anything else is a
        503 ``kv_transfer_unavailable``: never a 500 or a hang (the side channel bounds
        every call, ``transport.SideChannel``).
Rule 3: every claim made is released exactly once: when the KV arrived
        (``RequestHandle.on_kv_arrived``), at once when nothing is to be sent, or when its
        request ended first (refused after the claim, aborted, failed) -- as vLLM's decode
        side notifies its prefill to free the blocks in every one of those cases. Releases
        are sent by one background task, so the engine task that announces an arrival
        never waits for a socket; a release that fails is counted and left to the prefill
        server's expiry.
"""

from __future__ import annotations

import ipaddress
import json
import math
from typing import Any, Protocol

import attrs
import trio

from inference_lab.api.kv_transfer import RemotePrefill, claim_body, release_body
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.serve.transport import PeerAnswer, PeerUnavailable

__all__ = ["CLAIM_PATH", "RELEASE_PATH", "KVPulls", "Peers", "Pull", "PullCounts"]

#: The prefill server's side-channel routes (``serve/kv_routes.py``).
CLAIM_PATH = "/kv_transfer/claim"
RELEASE_PATH = "/kv_transfer/release"


class Peers(Protocol):
    """How a decode server reaches prefill servers: ``transport.SideChannel``, or a test's
    in-memory stand-in."""

    async def post(
        self, host: str, port: int, path: str, body: bytes, headers: list[tuple[str, str]]
    ) -> PeerAnswer: ...


@attrs.define(eq=False)
class Pull:
    """One claimed KV, released once (Rule 3)."""

    params: RemotePrefill
    model: str
    released: bool = False


@attrs.define
class PullCounts:
    """A model's pulls on a decode server: claims made and refused, releases sent and
    failed."""

    claims: int = 0
    claims_refused: int = 0
    releases: int = 0
    releases_failed: int = 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _in_any(host: str, networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]) -> bool:
    """Whether ``host`` is an address inside one of ``networks`` (a name is not)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return any(address in network for network in networks)


def _unavailable(message: str) -> ApiError:
    return ApiError(503, "kv_transfer_unavailable", message, "kv_transfer_params", "server_error")


class KVPulls:
    """The pulls of one decode server (the module rules)."""

    def __init__(self, peers: Peers, *, allowed: tuple[str, ...], api_key: str | None) -> None:
        self.peers = peers
        self.allowed = allowed
        #: the networks of ``allowed`` (Rule 1); its other entries are names or addresses
        self._networks = tuple(
            ipaddress.ip_network(host, strict=False) for host in allowed if "/" in host
        )
        self._headers = [("authorization", f"Bearer {api_key}")] if api_key else []
        self._send, self._receive = trio.open_memory_channel[Pull](math.inf)
        #: model -> its pulls' counts
        self.counts: dict[str, PullCounts] = {}

    def _counts(self, model: str) -> PullCounts:
        counts = self.counts.get(model)
        if counts is None:
            counts = self.counts[model] = PullCounts()
        return counts

    def check_peer(self, params: RemotePrefill) -> None:
        """Rule 1: a 400 unless this server may contact ``params``' host."""
        host = params.host.lower()
        if _loopback(host) or "*" in self.allowed or host.strip("[]") in self.allowed:
            return
        if self._networks and _in_any(host, self._networks):
            return
        raise ApiError(
            400,
            "invalid_value",
            f"kv_transfer_params.remote_host {truncate_echo(params.host)!r} is not a prefill "
            "server this decode server pulls from (loopback, or a host or network of --kv-peers)",
            "kv_transfer_params.remote_host",
        )

    async def claim(self, params: RemotePrefill, model: str, prompt_tokens: int) -> Pull:
        """Claim the KV ``params`` name for a request of ``model`` with ``prompt_tokens``
        (Rule 2); raises :class:`ApiError`."""
        self.check_peer(params)
        where = f"{params.host}:{params.port}"
        counts = self._counts(model)
        try:
            answer = await self.peers.post(
                params.host,
                params.port,
                CLAIM_PATH,
                claim_body(params, model, prompt_tokens),
                self._headers,
            )
        except PeerUnavailable as exc:
            counts.claims_refused += 1
            raise _unavailable(f"the prefill server at {where} holding the KV: {exc}") from None
        if answer.status == 200:
            counts.claims += 1
            return Pull(params, model)
        counts.claims_refused += 1
        message = _message(answer.body)
        if answer.status in (400, 404):
            raise ApiError(
                answer.status,
                "kv_not_found" if answer.status == 404 else "invalid_value",
                f"the prefill server at {where} refused the KV transfer: {message}",
                "kv_transfer_params",
            )
        raise _unavailable(
            f"the prefill server at {where} answered the claim with {answer.status}: {message}"
        )

    def release(self, pull: Pull) -> None:
        """Queue ``pull``'s release (Rule 3); synchronous, idempotent."""
        if pull.released:
            return
        pull.released = True
        self._send.send_nowait(pull)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send the releases queued, each in its own task; runs until cancelled."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for pull in self._receive:
                nursery.start_soon(self._send_release, pull)

    async def _send_release(self, pull: Pull) -> None:
        params = pull.params
        counts = self._counts(pull.model)
        try:
            answer = await self.peers.post(
                params.host, params.port, RELEASE_PATH, release_body(params), self._headers
            )
        except PeerUnavailable:
            counts.releases_failed += 1
            return
        if answer.status == 200:
            counts.releases += 1
        else:
            counts.releases_failed += 1


def _message(body: bytes) -> str:
    """The message of an OpenAI error envelope, else the body's start."""
    try:
        value: Any = json.loads(body)
        text = value["error"]["message"]
        if isinstance(text, str):
            return truncate_echo(text, 400)
    except (ValueError, KeyError, TypeError):
        pass
    return truncate_echo(body.decode("utf-8", "replace"), 200) or "(no body)"
