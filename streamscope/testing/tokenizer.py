"""A small byte-level BPE tokenizer trained here, so tests and demos need no hub."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]

# Enough varied English for a few hundred merges; the exact text does not matter.
CORPUS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "Interpretability researchers read the residual stream of a language model.",
    "Attention heads move information between positions; the MLP writes features.",
    "Once upon a time there was a small model that learned to count: one, two, three.",
    "Rome is in Italy, Berlin is in Germany, Madrid is in Spain and Lisbon is in Portugal.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Water boils at one hundred degrees Celsius at sea level.",
    "She opened the door, looked at the garden and smiled at the morning sun.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in many documents.",
]


def train_tokenizer(vocab_size: int = 512, corpus: Sequence[str] = CORPUS, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `corpus`, which puts its BOS token first in every prompt where
    `add_bos` (as Llama's does), or adds none (as GPT-2's and SmolLM2's do)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus) * 20, trainer=trainer)
    bos = tokenizer.token_to_id("<|bos|>")
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        padding_side="left",
    )


def word_tokenizer(vocab_size: int, bos_token_id: int = 0, eos_token_id: int = 1,
                   pad_token_id: int = 2) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with exactly `vocab_size` ids: the special tokens at the ids given, every other id
    the word ``w<id>`` (text is split at spaces; a word it does not know is read as the pad token).

    For a checkpoint whose model samples ids from a vocabulary far wider than
    a tokenizer trained on `CORPUS` (Llama-3's 128,256): every id the engine
    samples then decodes as a word, at a real tokenizer's cost. An id past a
    tokenizer's vocabulary costs vLLM's detokenizer some twenty times as much
    (a failed lookup each time), which would weigh on bare generation like no
    real model's tokenizer does.
    """
    bos, eos, pad = SPECIAL_TOKENS
    special = {bos_token_id: bos, eos_token_id: eos, pad_token_id: pad}
    vocab = {special.get(index, f"w{index}"): index for index in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=pad))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # words joined by spaces
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad,
                                   unk_token=pad, padding_side="left")


def save_tokenizer(path: str | Path, vocab_size: int = 512, corpus: Sequence[str] = CORPUS,
                   add_bos: bool = True) -> PreTrainedTokenizerFast:
    """Train a tokenizer on `corpus` (`train_tokenizer`) and save it into the checkpoint folder `path` (replacing
    any there)."""
    tokenizer = train_tokenizer(vocab_size, corpus, add_bos)
    tokenizer.save_pretrained(str(path))
    return tokenizer
