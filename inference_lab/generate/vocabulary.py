"""The placeholder vocabulary: the words every generated text is made of.

Rule 1: the vocabulary is fixed (50 words, in this order); the placeholder text
        (``api/text.py``), schema instances and agent answers all pick from it.
"""

from __future__ import annotations

__all__ = ["VOCABULARY"]

#: The placeholder vocabulary: token i of every response is ``VOCABULARY[i % 50] + " "``.
VOCABULARY: tuple[str, ...] = tuple(
    "the of and to in a is that for it was on are be with as at this have from or an by "
    "not but what all were when we there can which their if do will each about how up out "
    "them then she many some so these would".split()
)
assert len(VOCABULARY) == 50
