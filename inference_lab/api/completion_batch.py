"""The body of a ``/v1/completions`` request holding several prompts.

vLLM answers a list of prompts with one ``text_completion`` whose choices are every
prompt's, in order (choice ``c`` of prompt ``i`` at index ``i x n + c``), and whose
``usage`` sums the prompts' and the answers' tokens; lm-eval-harness's
``local-completions`` sends its requests so.

Rule 1: the body is built in pieces of bounded work (each prompt's choices through
        :func:`~inference_lab.api.encoding.choices_pieces`), so a batch of long echoed
        prompts never holds up its sender for long; the pieces concatenate to one JSON
        document.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs

from inference_lab.api.encoding import choices_pieces, usage
from inference_lab.api.requests import ParsedRequest
from inference_lab.jsonbytes import dumps

__all__ = ["PromptResult", "batch_pieces"]


@attrs.frozen(kw_only=True)
class PromptResult:
    """What the engine did with one prompt of a batch (its ``Finished``)."""

    completion_tokens: int
    finish_reason: str
    cached_tokens: int


def batch_pieces(
    requests: Sequence[ParsedRequest],
    results: Sequence[PromptResult],
    *,
    request_id: str,
    created: int,
) -> Iterator[bytes]:
    """The body of a batch of prompts (Rule 1), ``results[i]`` being ``requests[i]``'s."""
    first = requests[0]
    head = {"id": request_id, "object": "text_completion", "created": created, "model": first.model}
    yield dumps(head)[:-1] + b',"choices":['
    for i, (request, result) in enumerate(zip(requests, results, strict=True)):
        if i:
            yield b","
        yield from choices_pieces(
            request, completion_tokens=result.completion_tokens, finish_reason=result.finish_reason
        )
    total = usage(
        sum(r.prompt_tokens for r in requests),
        sum(r.n * result.completion_tokens for r, result in zip(requests, results, strict=True)),
        sum(result.cached_tokens for result in results),
    )
    yield b'],"usage":' + dumps(total) + b"}"
