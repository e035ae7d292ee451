"""Benchmark prompt counting: the per-request cost of a 1,000-token prompt.

Builds its tokenizers in-process (nothing is downloaded): a byte-level BPE trained with
``tokenizers`` on a synthetic corpus (saved as ``tokenizer.json`` in a temporary
directory) and a tiktoken encoding built from that BPE's ranks (saved as a ``.tiktoken``
rank file), each loaded through ``inference_lab.api.tokenizer.load_tokenizer`` exactly as the
server loads one. Each ``--tokenizer PATH`` adds a tokenizer file of your own. For each it
times ``parse_completion_request`` and ``parse_chat_request`` on a body whose prompt is
about 1,000 tokens, against the byte rule, and prints the median microseconds per request:
counting only, and counting and hashing for prefix caching (``api/hashing.py``, the
chain of the prompt and a 16-token answer at ``--block-size``), as a model that caches
prefixes parses it.

    python scripts/bench_tokenize.py [--tokens 1000] [--repeat 200] [--block-size 16]
        [--tokenizer PATH ...]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from inference_lab.api.hashing import PromptHashing
from inference_lab.api.requests import parse_chat_request, parse_completion_request
from inference_lab.api.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from inference_lab.errors import ConfigError

WORDS = (
    "the model serves requests in batches while the scheduler admits new work and the "
    "cache holds keys and values for every token of every running sequence; throughput "
    "rises with batch size until memory bandwidth or compute saturates"
).split()


def corpus(rng: np.random.Generator, lines: int) -> list[str]:
    """The benchmark's words plus random letter strings, so the BPE learns many merges."""
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    out = []
    for _ in range(lines):
        made = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(20)]
        out.append(" ".join([*rng.choice(WORDS, size=20), *made]) + ".")
    return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``tokenizers``' ByteLevel), character -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def build_tokenizers(directory: Path, vocab: int) -> dict[str, Path]:
    """Train the BPE and write it as tokenizer.json and as a tiktoken rank file."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(np.random.default_rng(0), 2000), trainer)
    hf_path = directory / "bpe" / "tokenizer.json"
    hf_path.parent.mkdir()
    tok.save(str(hf_path))
    decode = _byte_decoder()
    ranks = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    lines = [
        f"{base64.b64encode(bytes(decode[c] for c in token)).decode()} {rank}"
        for token, rank in ranks
    ]
    tt_path = directory / "bpe.tiktoken"
    tt_path.write_text("\n".join(lines) + "\n")
    return {"tokenizer.json (tokenizers)": hf_path, "rank file (tiktoken)": tt_path}


def prompt_of(tokenizer: Tokenizer, tokens: int) -> str:
    """Words of the corpus until ``tokenizer`` counts at least ``tokens``."""
    rng = np.random.default_rng(1)
    text = ""
    while tokenizer.count(text, add_special_tokens=False) < tokens:
        text += " ".join(rng.choice(WORDS, size=50)) + ". "
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids) if tokenizer.exact else text[: tokens * 4]


def median_us(call: Callable[[], Any], repeat: int) -> float:
    for _ in range(5):
        call()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=8000, help="trained BPE vocabulary")
    parser.add_argument("--tokenizer", type=Path, action="append", default=[])
    parser.add_argument("--block-size", type=int, default=16, help="hashing's block size")
    args = parser.parse_args()
    if args.tokens < 1 or args.repeat < 1 or args.vocab < 256 or args.block_size < 1:
        parser.error("--tokens, --repeat and --block-size must be at least 1, --vocab at least 256")
    hashing = PromptHashing(block_size=args.block_size, max_positions=1 << 20)
    for path in args.tokenizer:
        try:
            load_tokenizer(path)
        except ConfigError as exc:
            print(f"bench_tokenize: --tokenizer: {exc}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        paths = build_tokenizers(Path(tmp), args.vocab)
        print(f"trained a BPE in {time.perf_counter() - start:.1f} s")
        tokenizers: dict[str, Tokenizer] = {"byte rule": ByteTokenizer()}
        for name, path in [*paths.items(), *((str(p), p) for p in args.tokenizer)]:
            start = time.perf_counter()
            tokenizers[name] = load_tokenizer(path)
            elapsed = (time.perf_counter() - start) * 1e3
            print(f"loaded {name}: {tokenizers[name].vocab_size:,} tokens in {elapsed:.0f} ms")
        print(f"\nper request, median of {args.repeat}, prompt of ~{args.tokens} tokens:")
        print(
            f"{'tokenizer':32s} {'prompt tokens':>13s} {'completions':>12s} {'chat':>10s}"
            f" {'compl.+hash':>12s} {'chat+hash':>10s}"
        )
        for name, tok in tokenizers.items():
            text = prompt_of(tok, args.tokens)
            comp = {"model": "m", "prompt": text, "max_tokens": 16}
            chat = {"model": "m", "messages": [{"role": "user", "content": text}]}
            count = parse_completion_request(comp, 16, tokenizer=tok).prompt_tokens
            us_comp = median_us(
                partial(parse_completion_request, comp, 16, tokenizer=tok), args.repeat
            )
            us_chat = median_us(partial(parse_chat_request, chat, 16, tokenizer=tok), args.repeat)
            hc = median_us(
                partial(parse_completion_request, comp, 16, tokenizer=tok, hashing=hashing),
                args.repeat,
            )
            hchat = median_us(
                partial(parse_chat_request, chat, 16, tokenizer=tok, hashing=hashing), args.repeat
            )
            print(
                f"{name[:32]:32s} {count:13,d} {us_comp:10.1f}us {us_chat:8.1f}us"
                f" {hc:10.1f}us {hchat:8.1f}us"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
