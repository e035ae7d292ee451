"""Multi-turn sessions: a conversation's turns and the prompt each turn sends.

Turn ``k``'s prompt is the previous turn's prompt, the previous answer and ``k``'s new
user tokens, so every turn resends the whole conversation so far; the first turn's prompt
is the system prompt (if any) and its user tokens. A conversation is one token stream
(:class:`~inference_lab.traffic.hashing.SyntheticStream`): a shared system prompt is the
same blocks in every session, the rest is the session's own.

Rule 1: a plan is a value: its turns' lengths and think times are given (sampled by the
        caller), so the prompt lengths and hash chains are pure functions of it.
Rule 2: turn ``k``'s chain covers its prompt and its answer (``prompt_k + output_k``
        tokens, full blocks only): the answer's blocks are computed by turn ``k`` and
        resent by turn ``k + 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from inference_lab.traffic.hashing import SyntheticStream

__all__ = ["SessionPlan", "Turn", "shared_prefix"]


@attrs.frozen
class Turn:
    """One turn: ``user_tokens`` new tokens, an answer of ``output_tokens``, sent
    ``think_time`` seconds after the previous answer ended (0 for the first turn)."""

    user_tokens: int
    output_tokens: int
    think_time: float = 0.0


def shared_prefix(tokens: int, block_size: int) -> SyntheticStream | None:
    """The stream of a system prompt of ``tokens`` tokens shared by every session (None
    for an empty one)."""
    return SyntheticStream(-1, block_size) if tokens > 0 else None


class SessionPlan:
    """A session's turns (Rule 1). ``system_tokens`` open its first prompt; ``shared`` is
    the system prompt's stream when it is shared with other sessions (else the system
    prompt is the session's own); ``block_size`` None: no hashes (a deployment without
    prefix caching needs none)."""

    __slots__ = ("session", "turns", "system_tokens", "_stream", "_prompts")

    def __init__(
        self,
        session: int,
        turns: Sequence[Turn],
        system_tokens: int,
        block_size: int | None,
        shared: SyntheticStream | None = None,
    ) -> None:
        if not turns:
            raise ValueError("a session has at least one turn")
        self.session = session
        self.turns = tuple(turns)
        self.system_tokens = system_tokens
        self._stream = (
            None
            if block_size is None
            else SyntheticStream(session, block_size, shared, system_tokens if shared else 0)
        )
        prompts = []
        context = system_tokens
        for turn in self.turns:
            prompt = context + turn.user_tokens
            prompts.append(prompt)
            context = prompt + turn.output_tokens
        self._prompts = tuple(prompts)

    def prompt_tokens(self, k: int) -> int:
        """Turn ``k``'s prompt: the conversation so far plus its user tokens."""
        return self._prompts[k]

    def hashes(self, k: int) -> tuple[int, ...]:
        """Turn ``k``'s hash chain over its prompt and its answer (Rule 2)."""
        if self._stream is None:
            return ()
        return self._stream.hashes(self._prompts[k] + self.turns[k].output_tokens)
