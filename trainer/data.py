"""Corpus and tokenizer for the reference trainer, with nothing to download.

The default corpus is CPython's own English help texts (``pydoc_data.topics``,
about 0.47 MB), so a fresh machine trains without network access. Users pass
``.txt`` files or JSONL files of ``{"text": ...}`` lines instead. Tokens are
UTF-8 bytes (vocabulary 256), so there is no tokenizer to fetch either.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "DataError",
    "VOCAB_SIZE",
    "default_corpus",
    "load_corpus",
    "encode",
    "decode",
    "TokenDataset",
]

VOCAB_SIZE = 256


class DataError(ValueError):
    """A corpus file that is missing, unreadable or empty (the message is one line)."""


def default_corpus() -> str:
    """CPython's help topics, joined in sorted-key order (deterministic for one Python)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _read_one(path: Path) -> str:
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read data file {path}: {exc}") from None
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        texts = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f'{path}:{lineno}: expected an object with a "text" string')
            texts.append(obj["text"])
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise DataError(f"data file is empty: {path}")
    return raw


def load_corpus(paths: Sequence[str | Path] = ()) -> str:
    """The training text: the given files in order, or :func:`default_corpus`.

    Raises:
        DataError: a file is missing, unreadable, malformed JSONL or empty.
    """
    if not paths:
        return default_corpus()
    return "\n\n".join(_read_one(Path(p)) for p in paths)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as a 1-D LongTensor (values 0..255)."""
    data = text.encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return bytes(values).decode("utf-8", errors="replace")


class TokenDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens.

    ``dataset[i]`` is ``(input_ids, labels)``, both LongTensors of length
    ``seq_len``: ``labels`` is ``input_ids`` shifted by one (next-token targets),
    so the loss is a plain cross-entropy with no further shift.

    Raises:
        ValueError: ``seq_len < 1``.
        DataError: fewer than ``seq_len + 1`` tokens.
    """

    __slots__ = ("tokens", "seq_len", "_n")

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens.to(torch.long).reshape(-1)
        self.seq_len = seq_len
        self._n = self.tokens.numel() // (seq_len + 1)
        if self._n < 1:
            raise DataError(
                f"corpus has {self.tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}"
            )

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._n <= i < self._n:
            raise IndexError(f"index {i} out of range for {self._n} samples")
        i %= self._n
        w = self.tokens[i * (self.seq_len + 1) : (i + 1) * (self.seq_len + 1)]
        return w[:-1].clone(), w[1:].clone()

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked ``(input_ids, labels)`` of shape ``(len(indices), seq_len)``."""
        pairs = [self[i] for i in indices]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
