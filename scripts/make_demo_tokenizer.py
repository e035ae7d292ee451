"""Build a small local tokenizer directory for trying benchmark tools against the server.

aiperf and guidellm need a Hugging Face tokenizer to synthesize prompts and count tokens,
and the server counts prompts exactly with one (``--tokenizer PATH``). In practice point
all three at the served model's own tokenizer directory. To try it offline without one,
this script trains a small byte-level BPE with the ``tokenizers`` library (nothing is
downloaded) on a corpus made of the server's 50 placeholder words (so each word with a
leading space is one token and a client counting the streamed text gets the server's
``completion_tokens``) and the role names of its default chat rendering, plus any
``--corpus`` text files, and writes into ``OUT``:

- ``tokenizer.json``: the BPE (byte-level pre-tokenizer and decoder, one special token
  ``<|endoftext|>``, no BOS added), read by the server and by transformers;
- ``tokenizer_config.json``: ``{"tokenizer_class": "PreTrainedTokenizerFast", ...}`` so
  ``transformers.AutoTokenizer.from_pretrained(OUT)`` (what aiperf and guidellm call)
  loads it offline. It has no ``chat_template``: the server then counts a chat prompt
  over its default rendering (``user: <content>``), as docs/serve.md describes.

    python scripts/make_demo_tokenizer.py /tmp/demo-tokenizer [--corpus FILE ...]

The script checks the result with ``inference_lab.api.tokenizer.load_tokenizer`` and exits
with status 1 if a placeholder word is not a single token.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from inference_lab.api.text import VOCABULARY, placeholder_text
from inference_lab.api.tokenizer import load_tokenizer

END_OF_TEXT = "<|endoftext|>"
ROLES = ("user", "assistant", "system", "tool")


def placeholder_corpus(lines: int, seed: int) -> Iterator[str]:
    """Lines of placeholder words: the served cycle, then the words shuffled, some as
    ``<role>: ...`` lines of the server's default chat rendering, so BPE merges every
    word (with and without a leading space) and each role name into one token."""
    rng = random.Random(seed)
    yield placeholder_text(len(VOCABULARY) * 4).rstrip(" ")
    words = list(VOCABULARY)
    for i in range(lines):
        rng.shuffle(words)
        yield " ".join(words)
        yield f"{ROLES[i % len(ROLES)]}: " + " ".join(words[: 1 + i % len(words)])


def file_corpus(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        with path.open(encoding="utf-8", errors="replace") as handle:
            yield from (line.rstrip("\n") for line in handle)


def build(out: Path, corpus: list[Path], vocab_size: int, lines: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def text() -> Iterator[str]:
        yield from placeholder_corpus(lines, seed)
        yield from file_corpus(corpus)

    tokenizer.train_from_iterator(text(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def split_words(out: Path) -> list[str]:
    """The placeholder words that are not one token in the form the text carries them."""
    tokenizer = load_tokenizer(str(out))
    forms = [VOCABULARY[0]] + [" " + w for w in VOCABULARY]
    return [f for f in forms if tokenizer.count(f, add_special_tokens=False) != 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, metavar="OUT", help="directory to write")
    parser.add_argument(
        "--corpus",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="extra UTF-8 text file to train on (repeatable)",
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="at most this many tokens")
    parser.add_argument("--lines", type=int, default=2000, help="shuffled placeholder lines")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed")
    args = parser.parse_args()
    build(args.out, args.corpus, args.vocab_size, args.lines, args.seed)
    split = split_words(args.out)
    size = json.loads((args.out / "tokenizer.json").read_text())["model"]["vocab"]
    print(f"{args.out}: tokenizer.json ({len(size)} tokens), tokenizer_config.json")
    if split:
        print(f"make_demo_tokenizer: error: not one token: {split}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
