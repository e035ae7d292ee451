"""How long a prose answer is when nothing says so: the server's default length model.

A real model stops on its own: most answers end well before ``max_tokens`` with
``finish_reason: "stop"``, a few run into the cap. Without a ``--workload`` the server
draws each prose answer's length from :data:`DEFAULT_ANSWER_LENGTHS`, one seeded
generator per model (``serve/state.py``); the workload's ``output_len_dist``, a request's
``ignore_eos`` (run to ``max_tokens``) or ``min_tokens``, and the test harness's scripted
answers win over it. A JSON answer (tool calls, structured output) is as long as its
document and draws nothing.

Rule 1: the default is a lognormal whose mean is the mean response length of published
        chat logs (:data:`CHAT_LOG_MEAN_TOKENS`); its spread (:data:`SPREAD`) gives the
        long right tail such logs show. Both numbers are documented in ``docs/serve.md``.
Rule 2: a draw is capped by ``max_tokens`` (and a stop string): the answer then ends
        ``length``; below the cap it ends ``stop``.
"""

from __future__ import annotations

import math

from inference_lab.core.config import LengthDist, LognormalDist

__all__ = [
    "CHAT_LOG_MEAN_TOKENS",
    "DEFAULT_ANSWER_LENGTHS",
    "SPREAD",
    "median_tokens",
]

#: Mean tokens per response in LMSYS-Chat-1M (Zheng et al., "LMSYS-Chat-1M: A Large-Scale
#: Real-World LLM Conversation Dataset", ICLR 2024, Table 1): a million conversations
#: with 25 chat models.
CHAT_LOG_MEAN_TOKENS = 214.5
#: The lognormal's sigma (of the log of the length): the median is then
#: ``mean / e^(sigma^2 / 2)`` (130 tokens), one answer in four passes 256 tokens and one
#: in fifty passes 1,024.
SPREAD = 1.0
#: The default prose-length distribution (Rule 1): ``exp(N(mu, SPREAD))`` tokens, ``mu``
#: chosen so that the mean is :data:`CHAT_LOG_MEAN_TOKENS`.
DEFAULT_ANSWER_LENGTHS: LengthDist = LognormalDist(
    mean=round(math.log(CHAT_LOG_MEAN_TOKENS) - SPREAD**2 / 2, 4), std_dev=SPREAD
)


def median_tokens(dist: LognormalDist) -> float:
    """The median of a lognormal length distribution (``e^mu``), for the docs and tests."""
    return math.exp(dist.mean)
