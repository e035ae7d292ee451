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
Rule 3: a session file (JSONL, one session a line: :func:`write_sessions`,
        :func:`read_sessions`) holds sessions as values -- start time (None: a closed
        loop starts it), system prompt, turns -- so ``inference-lab sim`` can write the
        sessions it simulates and ``inference-lab load`` replay the same ones against a
        server. A bad line is one ConfigError naming the file, the line and the field;
        token counts are bounded as a trace's (``traces.MAX_TOKENS``), times by
        ``traces.MAX_SPAN``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from inference_lab.errors import ConfigError
from inference_lab.traffic.hashing import SyntheticStream
from inference_lab.traffic.traces import MAX_SPAN, MAX_TOKENS

__all__ = [
    "SessionPlan",
    "SessionRecord",
    "Turn",
    "read_sessions",
    "shared_prefix",
    "write_sessions",
]


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


@attrs.frozen(kw_only=True)
class SessionRecord:
    """One session of a session file (Rule 3): when it starts (seconds from the run's
    start; None: when a closed-loop user takes it), its system prompt and its turns."""

    session: int
    start: float | None
    system_prompt_tokens: int
    shared_system_prompt: bool
    turns: tuple[Turn, ...]


def write_sessions(path: str | Path, sessions: Iterable[SessionRecord]) -> int:
    """Write ``sessions`` as JSONL (Rule 3); returns how many. Raises OSError."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as fh:
        for r in sessions:
            row = {
                "session": r.session,
                "start": r.start,
                "system_prompt_tokens": r.system_prompt_tokens,
                "shared_system_prompt": r.shared_system_prompt,
                "turns": [
                    {
                        "user_tokens": t.user_tokens,
                        "output_tokens": t.output_tokens,
                        "think_time": t.think_time,
                    }
                    for t in r.turns
                ],
            }
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
            count += 1
    return count


class _Bad(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _int_field(
    row: Mapping[str, Any], key: str, minimum: int, where: str = "", maximum: int = MAX_TOKENS
) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _Bad(where + key, f"must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise _Bad(where + key, f"must be at most {maximum:,}, got {value!r}")
    return value


def _seconds(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Bad(field, f"must be a number of seconds >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise _Bad(field, f"must be a number of seconds >= 0, got {value!r}")
    if value > MAX_SPAN:
        raise _Bad(field, f"must be at most {MAX_SPAN:,.0f} s (366 days), got {value!r}")
    return float(value)


def _record(row: Mapping[str, Any]) -> SessionRecord:
    session = _int_field(row, "session", 0, maximum=2**63 - 1)  # (a 64-bit block label)
    start = row.get("start")
    system = _int_field(row, "system_prompt_tokens", 0) if "system_prompt_tokens" in row else 0
    shared = row.get("shared_system_prompt", True)
    if not isinstance(shared, bool):
        raise _Bad("shared_system_prompt", f"must be true or false, got {shared!r}")
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns:
        raise _Bad("turns", "must be a non-empty list of turns")
    out = []
    for k, turn in enumerate(turns):
        where = f"turns[{k}]."
        if not isinstance(turn, dict):
            raise _Bad(f"turns[{k}]", "must be an object")
        think = turn.get("think_time", 0.0)
        out.append(
            Turn(
                _int_field(turn, "user_tokens", 1, where),
                _int_field(turn, "output_tokens", 1, where),
                _seconds(think, where + "think_time"),
            )
        )
    total = system + sum(t.user_tokens + t.output_tokens for t in out)
    if total > MAX_TOKENS:  # the last turn resends all of it
        raise _Bad("turns", f"the conversation holds {total:,} tokens, more than {MAX_TOKENS:,}")
    return SessionRecord(
        session=session,
        start=None if start is None else _seconds(start, "start"),
        system_prompt_tokens=system,
        shared_system_prompt=shared,
        turns=tuple(out),
    )


def read_sessions(path: str | Path) -> tuple[SessionRecord, ...]:
    """The sessions of a session file (Rule 3), in file order. Raises ConfigError
    (``sessions.jsonl:4: turns[2].user_tokens: must be an integer >= 1, got 0``)."""
    file = Path(path)
    out = []
    try:
        with file.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{file}:{number}: invalid JSON: {exc.msg}") from None
                except RecursionError:
                    raise ConfigError(f"{file}:{number}: invalid JSON: nested too deep") from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{file}:{number}: must be a JSON object")
                try:
                    out.append(_record(row))
                except _Bad as exc:
                    raise ConfigError(f"{file}:{number}: {exc.field}: {exc}") from None
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None
    if not out:
        raise ConfigError(f"{file}: no sessions in the file")
    return tuple(out)
