"""A tokenizer and a causal LM built locally, for the data-path tests (no network): a small
BPE trained with the ``tokenizers`` library on CPython's help texts, and a tiny GPT-2 saved
with ``save_pretrained``; both load back through ``Auto*.from_pretrained(path)``."""

from __future__ import annotations

import functools
import json
from pathlib import Path

#: ids of the test tokenizer: more than 256, so its ids need 2 bytes (uint16)
VOCAB = 320


@functools.lru_cache(maxsize=1)
def tokenizer():
    """The test tokenizer (a ``PreTrainedTokenizerFast``; ``</s>`` ends a document, ``<pad>`` pads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trainer.data import default_corpus

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = default_corpus()
    tok.train_from_iterator((text[i:i + 2000] for i in range(0, 200_000, 2000)), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def save_tokenizer(path: Path) -> Path:
    tokenizer().save_pretrained(path)
    return path


def save_model(path: Path, *, n_positions: int = 64) -> Path:
    """A 1-layer GPT-2 over the test tokenizer's ids, saved with ``save_pretrained``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer()), n_positions=n_positions,
                        bos_token_id=tokenizer().eos_token_id, eos_token_id=tokenizer().eos_token_id,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def write_docs(path: Path, n: int, *, seed: int = 0, lengths: tuple[int, ...] = (3, 10, 40, 120)) -> Path:
    """``n`` documents of varied length (``lengths``: words; a few to several samples long) as JSONL
    ``{"text": ...}``."""
    import random

    from trainer.data import default_corpus

    words = default_corpus().split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            start, length = rng.randrange(len(words) - 200), rng.choice(lengths)
            f.write(json.dumps({"id": i, "text": " ".join(words[start:start + length])}) + "\n")
    return path
