"""Do client tokenizers count the server's placeholder text as ``completion_tokens``?

Every response is made of the 50 placeholder words, one token each; a benchmark client
(aiperf, guidellm) that tokenizes the text it received with its own tokenizer should get
the server's ``usage.completion_tokens``. This script loads each tokenizer file given
(a ``tokenizer.json``, a directory holding one, or a ``.tiktoken`` rank file — read with
``inference_lab.api.tokenizer.load_tokenizer``, nothing is downloaded) and prints, for
responses of 1, 50, 200 and 1,000 tokens, the count of the text exactly as the server
returns it (streamed and non-streamed text are the same) and which words are not a
single token in the form the text carries them (" word" after the first).

    python scripts/check_placeholder_tokens.py path/to/tokenizer.json path/to/cl100k_base.tiktoken

Exit status 1 when any count differs from the number of tokens.
"""

from __future__ import annotations

import argparse
import sys

from inference_lab.api.text import VOCABULARY, placeholder_text
from inference_lab.api.tokenizer import Tokenizer, load_tokenizer
from inference_lab.errors import ConfigError

LENGTHS = (1, 50, 200, 1000)


def served_text(tokens: int) -> str:
    """The text of a ``tokens``-token response as a client receives it (the last word
    carries no trailing space, streamed or not)."""
    return placeholder_text(tokens).rstrip(" ")


def check(tokenizer: Tokenizer) -> tuple[dict[int, int], list[str]]:
    """Counts of the served text per length, and the words whose in-text form (" word")
    is not one token."""
    counts = {n: tokenizer.count(served_text(n), add_special_tokens=False) for n in LENGTHS}
    split = [w for w in VOCABULARY if tokenizer.count(" " + w, add_special_tokens=False) != 1]
    return counts, split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizers", nargs="+", metavar="PATH", help="tokenizer files")
    args = parser.parse_args()
    ok = True
    for path in args.tokenizers:
        try:
            tokenizer = load_tokenizer(path)
        except ConfigError as exc:
            print(f"check_placeholder_tokens: error: {exc}", file=sys.stderr)
            return 1
        counts, split = check(tokenizer)
        exact = all(count == n for n, count in counts.items())
        ok = ok and exact
        shown = ", ".join(f"{n} -> {count}" for n, count in counts.items())
        print(f"{path}: {tokenizer.description}")
        print(f"  tokens -> client count: {shown} ({'exact' if exact else 'DIFFERS'})")
        print(f"  words not one token as ' word': {len(split)} {split[:10]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
