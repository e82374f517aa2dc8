"""Token ids for training: examples to ids, ids packed into fixed-length samples.

Packing: each example's ids (a text through the tokenizer, then its end-of-sequence
id; or the ``input_ids`` of a pre-tokenized example, as they are) are concatenated in
example order into one token stream, cut into non-overlapping windows of
``seq_len + 1`` ids. Window ``i`` is sample ``i``: ``input_ids = w[:-1]``,
``labels = w[1:]``. The cut depends only on the examples, the tokenizer and
``seq_len``, so sample ``i`` is the same sample however it is reached: from a packed
file (:class:`TokenWindows`) or read off a stream (:class:`trainer.stream.StreamSamples`).

Memory: the ids are kept in the smallest unsigned dtype that holds the vocabulary
(:func:`token_dtype`: 1 byte per id up to 256 ids, 2 up to 65,536, else 4), and a
packed file is memory-mapped (``numpy.memmap``), so a rank holds no copy of the
corpus: the ranks of a node share the page cache. Only the ids of the samples a
step trains on become int64, one micro batch at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "DataError",
    "token_dtype",
    "example_ids",
    "TokenWindows",
    "pack_to_file",
    "open_token_file",
    "tokenizer_key",
]

#: ids per tokenizer call when packing a file (fast tokenizers batch in Rust)
_PACK_BATCH = 512


class DataError(ValueError):
    """Training data that cannot be used (missing, malformed, empty); the message is one line."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0 .. vocab_size - 1``.

    Raises:
        ValueError: ``vocab_size < 1`` or ``> 2**32``.
    """
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in 1 .. 2**32, got {vocab_size}")
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise AssertionError("unreachable")


def vocab_size_of(tokenizer: Any) -> int:
    """Ids a ``transformers`` tokenizer can produce (its base vocabulary plus added tokens)."""
    return int(len(tokenizer))


def eos_id(tokenizer: Any) -> int | None:
    return getattr(tokenizer, "eos_token_id", None)


def example_ids(example: Any, tokenizer: Any, *, text_key: str = "text") -> list[int]:
    """The ids one example contributes to the packed stream.

    ``example``: a ``str`` (a text), a mapping with ``text_key`` (a text) or with
    ``input_ids`` (pre-tokenized: used as is, no id added). A text is tokenized without
    special tokens and followed by the tokenizer's end-of-sequence id (when it has one),
    so documents stay apart in the packed stream.

    Raises:
        DataError: the example is none of these, or a text comes without a tokenizer.
    """
    if isinstance(example, dict) and "input_ids" in example:
        ids = example["input_ids"]
        return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
    text = example.get(text_key) if isinstance(example, dict) else example
    if not isinstance(text, str):
        keys = sorted(example)[:8] if isinstance(example, dict) else type(example).__name__
        raise DataError(f'an example has no "{text_key}" text and no "input_ids" (it has {keys}): '
                        "set the text field (--text-key) or pre-tokenize")
    if tokenizer is None:
        raise DataError("text examples need a tokenizer (--tokenizer NAME_OR_PATH)")
    return _encode_texts([text], tokenizer)[0]


def _encode_texts(texts: list[str], tokenizer: Any) -> list[list[int]]:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = eos_id(tokenizer)
    return [list(x) + ([eos] if eos is not None else []) for x in ids]


def _window(tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    return w[:-1], w[1:]


class TokenWindows:
    """Map-style samples over a 1-D array of token ids: non-overlapping windows of
    ``seq_len + 1`` ids, ``dataset[i]`` = ``(input_ids, labels)``, both int64 tensors of
    length ``seq_len`` (``labels`` shifted by one: a plain cross-entropy, no further shift).

    ``tokens``: a numpy array (a ``numpy.memmap`` is not copied) or a CPU tensor, of any
    integer dtype; it is kept in its dtype (use :func:`token_dtype`).

    Raises:
        ValueError: ``seq_len < 1``.
        DataError: fewer than ``seq_len + 1`` ids.
    """

    __slots__ = ("tokens", "seq_len", "_n")

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().reshape(-1).numpy()
        self.tokens = tokens.reshape(-1)
        self.seq_len = seq_len
        self._n = self.tokens.shape[0] // (seq_len + 1)
        if self._n < 1:
            raise DataError(f"corpus has {self.tokens.shape[0]} tokens, fewer than seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._n <= i < self._n:
            raise IndexError(f"index {i} out of range for {self._n} samples")
        i %= self._n
        return _window(self.tokens[i * (self.seq_len + 1): (i + 1) * (self.seq_len + 1)])

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked ``(input_ids, labels)`` of shape ``(len(indices), seq_len)``, int64."""
        pairs = [self[i] for i in indices]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    @property
    def bytes_per_token(self) -> int:
        return int(self.tokens.dtype.itemsize)


def tokenizer_key(tokenizer: Any) -> str:
    """A digest that changes when the tokenizer's ids would (its serialized model and
    added tokens for a fast tokenizer; else its name and vocabulary)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr(getattr(tokenizer, "name_or_path", "")).encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr(eos_id(tokenizer)).encode())
    return h.hexdigest()[:16]


def pack_to_file(examples: Iterable[Any], tokenizer: Any, path: str | Path, *, text_key: str = "text",
                 vocab_size: int | None = None) -> np.memmap:
    """Tokenize ``examples`` in order (:func:`example_ids`) into a flat file of ids in
    :func:`token_dtype` and return it memory-mapped (read-only). Written to a temporary
    name and renamed: a reader never sees half a file, and ranks that pack the same
    examples at once each write the same bytes. A sidecar ``<path>.json`` records the
    dtype and the count.

    Raises:
        DataError: an example is unusable, an id is outside the vocabulary, or no ids.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size if vocab_size is not None else vocab_size_of(tokenizer)
    dtype = token_dtype(vocab)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with open(tmp, "wb") as f:
            for ids in _ids_in_batches(examples, tokenizer, text_key):
                arr = np.asarray(ids, dtype=np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                    raise DataError(f"token id {int(arr.max() if arr.max() >= vocab else arr.min())} is outside "
                                    f"the vocabulary of {vocab}: the tokenizer and the model disagree")
                f.write(arr.astype(dtype).tobytes())
                count += arr.size
        if count == 0:
            raise DataError(f"no tokens to pack into {path}: the data is empty")
        meta = {"dtype": dtype.name, "tokens": count, "vocab_size": vocab}
        Path(f"{tmp}.json").write_text(json.dumps(meta))
        os.replace(tmp, path)
        os.replace(f"{tmp}.json", f"{path}.json")
    finally:
        for leftover in (tmp, Path(f"{tmp}.json")):
            leftover.unlink(missing_ok=True)
    return open_token_file(path)


def _ids_in_batches(examples: Iterable[Any], tokenizer: Any, text_key: str) -> Iterator[list[int]]:
    """:func:`example_ids` of each example, texts tokenized ``_PACK_BATCH`` at a time."""
    texts: list[str] = []
    for ex in examples:
        if isinstance(ex, dict) and "input_ids" in ex:
            if texts:
                yield from _encode_texts(texts, tokenizer)
                texts = []
            yield example_ids(ex, tokenizer, text_key=text_key)
            continue
        text = ex.get(text_key) if isinstance(ex, dict) else ex
        if not isinstance(text, str) or tokenizer is None:
            yield example_ids(ex, tokenizer, text_key=text_key)  # raises its DataError
        texts.append(text)
        if len(texts) >= _PACK_BATCH:
            yield from _encode_texts(texts, tokenizer)
            texts = []
    if texts:
        yield from _encode_texts(texts, tokenizer)


def open_token_file(path: str | Path) -> np.memmap:
    """A file written by :func:`pack_to_file`, memory-mapped read-only.

    Raises:
        DataError: the file or its sidecar is missing, or they disagree.
    """
    path = Path(path)
    try:
        meta = json.loads(Path(f"{path}.json").read_text())
        tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"cannot open token file {path}: {exc}") from None
    if tokens.shape[0] != meta["tokens"]:
        raise DataError(f"token file {path} has {tokens.shape[0]} ids, its sidecar says {meta['tokens']}")
    return tokens
