"""What an agent's answer is, and what its tokens spell.

What the client asked -- tools, ``tool_choice``, structured output, reasoning -- is read
by :mod:`inference_lab.api.agent_request` (:class:`AgentRequest`, re-exported here).
:func:`plan_answer` decides the answer's shape with the request's own generator
(:func:`content_rng`), and :class:`Layout` says what each of its tokens spells once the
engine has fixed how many there are.

Rule 1: content is a pure function of the request (its JSON without the fields of
        :data:`NOT_CONTENT`: delivery, budget, effort), the server's ``--seed`` and
        ``--tool-call-probability``: every draw comes from :func:`content_rng`; only ids
        are random. Whether an ``auto`` answer calls a tool is drawn with the chance
        :func:`~inference_lab.api.tool_choice.call_probability` gives the conversation.
Rule 2: a JSON answer (tool calls, structured output) is a complete document of
        :attr:`AnswerPlan.fixed` tokens, its own length: the engine is asked for exactly
        that many (plus the reasoning before it). When ``max_tokens`` is smaller the
        answer is the document's first tokens and its finish reason is ``length``.
Rule 3: a token of generated text is one piece of :func:`split_pieces` (a word with its
        leading space, up to 3 digits, up to 3 other characters, or a run of spaces); a
        tool call costs one token for its id and name, then one per argument piece.
Rule 4: reasoning takes the first tokens of an answer: ``floor(ratio x length)`` of a
        prose answer, ``ceil(ratio x D / (1 - ratio))`` before a JSON answer of ``D``
        tokens (in exact arithmetic on the ratio as written), ``ratio`` being the model's for the request's effort
        (:class:`~inference_lab.core.config.ReasoningConfig`). Reasoning text is
        placeholder words.
Rule 5: a schema no instance satisfies, or one that is malformed, is a 400 naming the
        tool (``tools[i].function.parameters``) or the format's field, found at parse
        time whatever the answer's draw.
Rule 6: planning spends from one :class:`~inference_lab.generate.budget.Budget` (every
        tool's schema, the structured output): past its work a 400 names the schema path
        that is too expensive. Each generated document is at most :func:`document_bytes`
        (``n``) bytes, counted while it is built, and the documents an answer emits, times
        ``n``, at most :data:`MAX_ANSWER_BYTES`: a larger answer is a 400 before it is
        generated, whatever its token count.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Literal

import attrs

from inference_lab.api.agent_request import (
    AgentRequest,
    FunctionTool,
    StructuredOutput,
    parse_chat_agent,
    parse_effort,
    parse_function_tool,
    parse_tool_choice,
)
from inference_lab.api.answer_bounds import (
    MAX_ANSWER_BYTES,
    MAX_DOCUMENT_TOKENS,
    budget_error,
    check_answer_bytes,
    check_document,
    document_bytes,
)
from inference_lab.api.encoding import random_hex
from inference_lab.api.requests import ParsedRequest
from inference_lab.api.schema import invalid_value
from inference_lab.api.text import VOCABULARY, WORDS, placeholder_text, token_start
from inference_lab.api.tool_choice import call_probability
from inference_lab.core.config import ReasoningConfig
from inference_lab.errors import ApiError
from inference_lab.generate.budget import Budget, OutOfWork
from inference_lab.generate.instances import SchemaError, generate_instance
from inference_lab.generate.patterns import PatternError, pattern_string

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_DOCUMENT_TOKENS",
    "AgentRequest",
    "AnswerPlan",
    "FunctionTool",
    "Layout",
    "StructuredOutput",
    "ToolCall",
    "call_id",
    "content_rng",
    "parse_chat_agent",
    "parse_effort",
    "parse_function_tool",
    "parse_tool_choice",
    "plan_answer",
    "reasoning_ratio",
    "split_pieces",
]

#: Most calls in one answer when parallel tool calls are allowed.
MAX_PARALLEL_CALLS = 3
#: The default chance that a ``tool_choice: "auto"`` answer to a fresh question that a
#: tool fits calls a tool (``api/tool_choice.py``).
DEFAULT_TOOL_CALL_PROBABILITY = 0.9
_PIECE = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}|\s+|[^A-Za-z0-9\s]{1,3}")


def split_pieces(text: str) -> tuple[str, ...]:
    """``text`` as the tokens that spell it (Rule 3); they concatenate to ``text``."""
    return tuple(_PIECE.findall(text))


#: Body fields that do not change what an answer says: how it is delivered, how much of
#: it is wanted, how long the model reasons first (Rule 1).
NOT_CONTENT = frozenset(
    {
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "n",
        "priority",
        "user",
        "prompt_cache_key",
        "metadata",
        "store",
        "logprobs",
        "top_logprobs",
        "reasoning_effort",
        "reasoning",
    }
)


def content_rng(seed: int, raw: Mapping[str, Any]) -> random.Random:
    """The generator of one request's content (Rule 1): seeded by ``seed`` and a hash of
    the request body without :data:`NOT_CONTENT`, so the same question streamed or not,
    with a smaller budget or another effort, gets the same answer (or its prefix)."""
    body = {k: v for k, v in raw.items() if k not in NOT_CONTENT}
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    digest = hashlib.sha256(f"{seed}\x00{text}".encode("utf-8", "surrogatepass")).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))


# ---------------------------------------------------------------------------------------
# the answer


@attrs.frozen(kw_only=True)
class ToolCall:
    """One generated call: its function, its arguments (a JSON object's text) and the
    pieces that spell them (Rule 3)."""

    name: str
    arguments: str
    pieces: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return 1 + len(self.pieces)


@attrs.frozen(kw_only=True)
class AnswerPlan:
    """The shape of an answer, decided at parse time: tool calls, a fixed text (a
    structured output), or prose whose length the engine decides; with reasoning first
    when ``ratio`` is set."""

    calls: tuple[ToolCall, ...] = ()
    #: The pieces of a structured output (None: prose, or calls).
    text: tuple[str, ...] | None = None
    #: The share of output tokens spent reasoning (None: the answer does not reason).
    ratio: float | None = None

    @property
    def fixed(self) -> int | None:
        """Tokens of the JSON answer (Rule 2), None for prose."""
        if self.calls:
            return sum(c.tokens for c in self.calls)
        if self.text is not None:
            return len(self.text)
        return None

    @property
    def reasoning_before_fixed(self) -> int:
        fixed = self.fixed
        if fixed is None or not self.ratio:
            return 0
        ratio = _exact(self.ratio)
        return math.ceil(ratio * fixed / (1 - ratio))

    def reasoning_of(self, length: int) -> int:
        """Reasoning tokens of a prose answer of ``length`` tokens (Rule 4)."""
        return math.floor(_exact(self.ratio) * length) if self.ratio else 0

    def limit(self, parsed: ParsedRequest) -> tuple[int, bool]:
        """What admission caps the response length at, and whether a drawn length applies
        (prose without ``ignore_eos`` only: a JSON answer's document decides its length)."""
        fixed = self.fixed
        if fixed is None:
            return parsed.output_cap, not parsed.ignore_eos
        return self.reasoning_before_fixed + fixed, False

    def layout(self, parsed: ParsedRequest, length: int) -> Layout:
        """What each of the answer's ``length`` tokens spells (``length``: the engine's,
        ``RequestHandle.length`` or ``Finished.output_tokens``)."""
        return Layout(self, parsed, length)


Token = tuple[Literal["reasoning", "content", "call", "arguments"], int, str]


class Layout:
    """The tokens of one answer of ``length`` tokens: ``token(i)`` is ``(kind, call,
    text)`` -- ``reasoning`` / ``content`` text, the ``call`` opening call number
    ``call``, or a piece of its ``arguments``."""

    __slots__ = ("plan", "length", "reasoning", "_prose", "_content", "_calls")

    def __init__(self, plan: AnswerPlan, parsed: ParsedRequest, length: int) -> None:
        self.plan = plan
        self.length = length
        fixed = plan.fixed
        if fixed is None:
            self.reasoning = plan.reasoning_of(length)
            self._prose: str | None = parsed.output_text(length)
        else:
            self.reasoning = min(length, plan.reasoning_before_fixed)
            self._prose = None
        self._content: list[str] | None = None
        #: (first token, call) of each call
        self._calls: list[tuple[int, ToolCall]] = []
        at = self.reasoning
        for call in plan.calls:
            self._calls.append((at, call))
            at += call.tokens

    @property
    def complete(self) -> bool:
        """Whether a JSON answer ended where its document does (prose: always)."""
        fixed = self.plan.fixed
        return fixed is None or self.length >= self.reasoning + fixed

    def finish_reason(self, parsed: ParsedRequest, engine_reason: str) -> str:
        if self.plan.fixed is None:
            return parsed.finish_reason(engine_reason, self.length)
        if not self.complete:
            return "length"
        return "tool_calls" if self.plan.calls else "stop"

    def token(self, i: int) -> Token:
        prose = self._prose
        if prose is not None:  # one text, its first tokens reasoning (a stop string cuts both)
            kind: Literal["reasoning", "content"] = "reasoning" if i < self.reasoning else "content"
            return kind, 0, prose[token_start(i) : token_start(i + 1)]
        if i < self.reasoning:
            return "reasoning", 0, WORDS[i % len(WORDS)]
        text = self.plan.text
        if text is not None:
            return "content", 0, text[i - self.reasoning]
        for number in range(len(self._calls) - 1, -1, -1):
            first, call = self._calls[number]
            if i >= first:
                if i == first:
                    return "call", number, ""
                return "arguments", number, call.pieces[i - first - 1]
        raise IndexError(i)

    def reasoning_text(self) -> str:
        if self._prose is not None:
            return self._prose[: token_start(self.reasoning)]
        return placeholder_text(self.reasoning)

    def content_text(self) -> str:
        """The text answer's tokens after the reasoning ("" for a tool-call answer)."""
        if self._prose is not None:
            return self._prose[token_start(self.reasoning) :]
        text = self.plan.text
        if text is None:
            return ""
        return "".join(text[: max(0, self.length - self.reasoning)])

    def calls(self) -> list[tuple[ToolCall, str]]:
        """Each call begun within the length, with the arguments emitted so far."""
        out = []
        for first, call in self._calls:
            if first >= self.length:
                break
            emitted = max(0, min(len(call.pieces), self.length - first - 1))
            out.append((call, "".join(call.pieces[:emitted])))
        return out


def _exact(ratio: float) -> Fraction:
    """A ratio as the decimal it was written as (``0.8`` is 4/5: ``ceil`` and ``floor``
    of its products are then exact)."""
    return Fraction(repr(ratio))


def _document(value: Any) -> tuple[str, tuple[str, ...]]:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text, split_pieces(text)


def _json_object(rng: random.Random) -> Any:
    """A small JSON object of placeholder keys and values."""
    keys = rng.sample(VOCABULARY, rng.randint(1, 4))
    out: dict[str, Any] = {}
    for key in keys:
        kind = rng.randrange(4)
        if kind == 0:
            out[key] = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(1, 4)))
        elif kind == 1:
            out[key] = rng.randint(0, 1000)
        elif kind == 2:
            out[key] = rng.random() < 0.5
        else:
            out[key] = [rng.choice(VOCABULARY) for _ in range(rng.randint(1, 3))]
    return out


def _schema_error(param: str, name: str | None, exc: SchemaError) -> ApiError:
    where = f"{param}{exc.path}" if exc.path else param
    subject = f"tool {name!r}: " if name is not None else ""
    return ApiError(400, "invalid_schema", f"{subject}{where}: {exc.reason}", param)


def _arguments(
    tool: FunctionTool, rng: random.Random, budget: Budget, limit: int
) -> tuple[str, tuple[str, ...]]:
    budget.new_document(limit)
    try:
        value = generate_instance(tool.parameters, rng, budget)
    except SchemaError as exc:
        raise _schema_error(tool.param, tool.name, exc) from None
    if type(value) is not dict:
        raise ApiError(
            400,
            "invalid_schema",
            f"tool {tool.name!r}: {tool.param} must describe an object",
            tool.param,
        )
    return check_document(_document(value), tool.param, tool.name, limit)


def _structured(
    output: StructuredOutput, rng: random.Random, budget: Budget, n: int
) -> tuple[str, ...]:
    budget.new_document(document_bytes(n))
    if output.kind == "json_object":
        return _document(_json_object(rng))[1]
    if output.kind in ("choice", "regex"):
        try:
            if output.kind == "choice":
                text = rng.choice(output.choices)
                budget.spend_bytes(len(text.encode("utf-8", "surrogatepass")))
            else:
                assert output.pattern is not None
                text = pattern_string(output.pattern, rng, budget=budget)
                budget.spend_bytes(len(text))
        except PatternError as exc:
            raise invalid_value(output.param, f"{output.param}: {exc}") from None
        except OutOfWork as exc:
            if exc.what not in ("work", "bytes"):
                raise
            raise budget_error(output.param, exc, budget, n) from None
        return split_pieces(text)
    try:
        value = generate_instance(output.schema, rng, budget)
    except SchemaError as exc:
        raise _schema_error(output.param, None, exc) from None
    return check_document(_document(value), output.param, None, document_bytes(n))[1]


def reasoning_ratio(
    config: ReasoningConfig | None, effort: str | None, thinking: bool | None
) -> float | None:
    """The share of the answer spent reasoning (Rule 4), None when it does not reason:
    a model without reasoning, effort ``none``, or ``enable_thinking: false``."""
    if config is None or thinking is False:
        return None
    chosen = effort if effort is not None else config.default_effort
    if chosen == "none" and thinking is True and effort is None:
        chosen = "medium"
    ratio = config.ratio(chosen)
    return ratio if ratio > 0 else None


def plan_answer(
    agent: AgentRequest,
    rng: random.Random,
    *,
    reasoning: ReasoningConfig | None = None,
    tool_call_probability: float = DEFAULT_TOOL_CALL_PROBABILITY,
    n: int = 1,
    budget: Budget | None = None,
) -> AnswerPlan | None:
    """The answer's shape (Rules 1, 2, 4, 5, 6), or None for a plain prose answer without
    reasoning (the completion route's own path). Every tool's schema is checked, and the
    structured output's, whatever the draw decides, spending ``budget`` (default: a whole
    request's); its ``inline`` or ``cancelled`` exhaustion leaves as ``OutOfWork``."""
    spend = Budget() if budget is None else budget
    limit = document_bytes(n)
    ratio = reasoning_ratio(reasoning, agent.effort, agent.thinking)
    arguments = {tool.name: _arguments(tool, rng, spend, limit) for tool in agent.tools}
    text = _structured(agent.output, rng, spend, n) if agent.output is not None else None
    calls: tuple[ToolCall, ...] = ()
    if agent.tools and agent.tool_choice != "none":
        if agent.tool_choice == "function":
            names = [agent.named]
        elif agent.tool_choice == "required" or rng.random() < call_probability(
            agent.turn, [t.words for t in agent.tools], tool_call_probability
        ):
            count = 1
            if agent.parallel_tool_calls:
                count = rng.randint(1, min(MAX_PARALLEL_CALLS, len(agent.tools)))
            names = [t.name for t in rng.sample(list(agent.tools), count)]
        else:
            names = []
        calls = tuple(
            ToolCall(name=name, arguments=arguments[name][0], pieces=arguments[name][1])
            for name in names
            if name is not None
        )
    param = agent.output.param if agent.output is not None else "tools"
    if calls:
        check_answer_bytes([c.arguments for c in calls], n, "tools")
        return AnswerPlan(calls=calls, ratio=ratio)
    if text is not None:
        check_answer_bytes(["".join(text)], n, param)
        return AnswerPlan(text=text, ratio=ratio)
    if ratio is not None:
        return AnswerPlan(ratio=ratio)
    return None


def call_id() -> str:
    """A tool call's id (random: ids are not content, Rule 1)."""
    return f"call_{random_hex()[:24]}"
