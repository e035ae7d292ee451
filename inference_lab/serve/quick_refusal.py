"""A completion request refused with a 529 where its bytes are read.

A refused client backs off and comes back on a new connection, so under a refusal storm
most of the server's work is refusing: each refusal taken through hypercorn's request task,
the app's ASGI connection and the completion route waits behind the streams' work at every
scheduling point on that path. When a model's waiting places are all taken, a completion
request that came whole in one read is answered by the connection's reading task instead
(``transport/quick.py``), when the route would answer it with that model's 529.

Rule 1: the quick path answers only a 529, and exactly the route's: the same checks run in
        the route's order on the same values (the gate, the body's size, JSON and field
        validation with the model's tokenizer and prefix hashing, the model, the harness,
        agent fields, fit, the shutdown, then admission's decision), and every outcome but
        the 529 -- a 400, a 404, a 503, a request the harness, an answer plan or a
        prefill/decode hand-off would take, a request admission would admit -- is left to
        the route (None), with nothing changed on the way.
Rule 2: the refusal is counted and told as the route's is (``ModelRuntime.refuse_nowait``),
        and carries the same headers (request id, CORS, the pacing lag, ``Retry-After``,
        ``x-should-retry``) and body.
Rule 3: the first look (:func:`refusing`) costs O(models) and nothing while no model's
        waiting places are all taken, so requests on a server that refuses nothing pay
        nothing for this path.

Who calls this: ``InferenceLabApp.quick_post`` (``serve/asgi.py``), for a ``POST`` of a
completion path that the connection read whole.
"""

from __future__ import annotations

import trio

from inference_lab.api.kv_transfer import FIELD as KV_FIELD
from inference_lab.api.requests import MAX_BODY_BYTES
from inference_lab.core.engine import RequestSpec
from inference_lab.errors import ApiError
from inference_lab.serve import gate
from inference_lab.serve.agents import may_plan, refuse_structured
from inference_lab.serve.completions import COMPLETION_ROUTES, check_fit, parse_body
from inference_lab.serve.error_replies import error_reply
from inference_lab.serve.exchange import Exchange
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport import QuickReply

__all__ = ["QUICK_POSTS", "quick_refusal", "refusing"]

#: The request targets whose POSTs the connection may refuse itself.
QUICK_POSTS = frozenset(path.encode() for path in COMPLETION_ROUTES)


def refusing(state: ServeState) -> bool:
    """Whether some model would refuse an arrival that finds no seat (Rule 3)."""
    return not state.draining and any(r.at_bound() for r in state.runtimes.values())


def quick_refusal(
    state: ServeState,
    path: str,
    headers: list[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
    body: bytes,
) -> QuickReply | None:
    """The route's 529 for this ``POST`` (``path`` a completion route's, ``body`` whole),
    or None for the route to answer it (Rule 1)."""
    kind = COMPLETION_ROUTES.get(path)
    if kind is None or state.draining or len(body) > MAX_BODY_BYTES:
        return None
    exchange = Exchange.read_whole("POST", path, headers, client, trio.current_time())
    gate.prepare(state, exchange)
    if gate.check(state, exchange) is not None:
        return None
    try:
        raw, batch = parse_body(state, kind, body)
        parsed = batch[0]
        runtime = state.runtime_for(parsed.model)
        if (
            len(batch) > 1
            or runtime is None
            or not runtime.at_bound()
            or (KV_FIELD in raw and state.kv.role != "both")
            or not state.harness.passes(exchange)
            or (kind == "chat" and may_plan(runtime, raw))
        ):
            return None
        if kind == "completions":
            refuse_structured(raw)
        engine_prompt = check_fit(runtime, parsed)
    except ApiError:
        return None
    exchange.note_pacing_lag(runtime.pacing_lag())
    spec = RequestSpec(
        prompt_tokens=engine_prompt,
        max_tokens=parsed.engine_max_tokens,
        n=parsed.n,
        block_hashes=parsed.block_hashes,
        session=parsed.session,
    )
    refusal = runtime.refuse_nowait(spec)
    if refusal is None:
        return None
    reply = error_reply(refusal, should_retry_header=state.settings.should_retry_header)
    return QuickReply(reply.status, reply.header_list(exchange.headers), reply.body)
