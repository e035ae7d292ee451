"""Tokenizers built in tests: a byte-level BPE trained on a tiny corpus, tiktoken rank
files, a chat template. Nothing is downloaded."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, héllo wörld, the of and to in",
    "user: what is the answer?\nassistant: forty two",
] * 30


def train_bpe(directory: Path, *, bos: bool = False) -> Path:
    """A byte-level BPE of a few hundred tokens trained on CORPUS, saved as
    ``directory/tokenizer.json``; with ``bos`` its post-processor prepends ``<s>``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def write_ranks(path: Path, merges: list[bytes]) -> Path:
    """A tiktoken rank file: the 256 single bytes, then ``merges`` in rank order."""
    tokens = [bytes([b]) for b in range(256)] + merges
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")
    return path


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'bad' %}{{ raise_exception('roles must be user or assistant') }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_template(directory: Path, template: str = TEMPLATE) -> None:
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
