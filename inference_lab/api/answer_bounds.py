"""The bounds of a generated answer's content (:mod:`inference_lab.api.agents` Rule 6).

Rule 1: a generated JSON document is at most :data:`MAX_DOCUMENT_TOKENS` tokens and
        :func:`document_bytes` bytes (counted while it is built, checked once encoded).
Rule 2: the documents an answer emits, times its ``n`` choices, are at most
        :data:`MAX_ANSWER_BYTES`: a letters-only string is one token, so the token caps
        alone do not bound a reply's size.
Rule 3: every refusal is a 400 naming the body field (``tools[i].function.parameters``,
        the structured output's field, or ``n``).
"""

from __future__ import annotations

from inference_lab.api.schema import invalid_value
from inference_lab.errors import ApiError
from inference_lab.generate.budget import MAX_OUTPUT_BYTES, Budget, OutOfWork

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_DOCUMENT_TOKENS",
    "budget_error",
    "check_answer_bytes",
    "check_document",
    "document_bytes",
]

#: Tokens of one generated JSON document at most (a schema whose smallest instance is
#: longer is a 400): far above any tool call, far below the work cap of a request.
MAX_DOCUMENT_TOKENS = 65_536
#: Bytes of generated content (JSON documents, a chosen string, a regex match) one
#: answer emits across its ``n`` choices (Rule 2): a letters-only string is one token,
#: so tokens alone do not bound a reply's size.
MAX_ANSWER_BYTES = 16 * 1024 * 1024


def document_bytes(n: int) -> int:
    """Bytes one generated document may hold in an answer of ``n`` choices."""
    return min(MAX_OUTPUT_BYTES, MAX_ANSWER_BYTES // max(1, n))


def check_document(
    document: tuple[str, tuple[str, ...]], param: str, name: str | None, limit: int
) -> tuple[str, tuple[str, ...]]:
    """``document`` (text, pieces), or a 400 naming ``param`` when it passes
    :data:`MAX_DOCUMENT_TOKENS` or ``limit`` bytes."""
    subject = f"tool {name!r}: " if name is not None else ""
    if len(document[1]) > MAX_DOCUMENT_TOKENS:
        raise ApiError(
            400,
            "invalid_schema",
            f"{subject}{param}: its instances run past {MAX_DOCUMENT_TOKENS:,} tokens",
            param,
        )
    size = len(document[0].encode("utf-8", "surrogatepass"))
    if size > limit:  # (escapes the generator's count does not see)
        raise ApiError(
            400,
            "invalid_schema",
            f"{subject}{param}: its instances run past the {limit:,} bytes of JSON this "
            "request may generate",
            param,
        )
    return document


def budget_error(param: str, exc: OutOfWork, budget: Budget, n: int) -> ApiError:
    """The 400 of a structured output (a choice, a regex) past its budget (Rule 6)."""
    if exc.what == "bytes":
        reason = (
            f"its answer runs past {budget.bytes_limit:,} bytes (with n = {n}, at most "
            f"{MAX_ANSWER_BYTES:,} bytes across the choices)"
        )
    else:
        reason = f"matching this pattern takes more than this server's {budget.limit:,} steps"
    return invalid_value(param, f"{param}: {reason}")


def check_answer_bytes(documents: list[str], n: int, param: str) -> None:
    """A 400 when the documents an answer emits, times ``n``, pass
    :data:`MAX_ANSWER_BYTES` (Rule 2): several tool calls, each within its own bound,
    may be too many together."""
    size = n * sum(len(d.encode("utf-8", "surrogatepass")) for d in documents)
    if size > MAX_ANSWER_BYTES:
        raise invalid_value(
            "n" if n > 1 else param,
            f"the answer's generated content is {size:,} bytes across n = {n} choices, more "
            f"than this server's {MAX_ANSWER_BYTES:,}: lower n or ask for smaller documents",
        )
