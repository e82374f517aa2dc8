"""Training data for the elastic jobs: the reference corpus, and any dataset with a tokenizer.

What :class:`trainer.loop.ElasticJob` trains on is a *sample source* addressed by global
sample position (:mod:`trainer.sampler`), built by :func:`as_samples` from

- token ids (a tensor or numpy array, a ``numpy.memmap`` of a packed file): windows of
  ``seq_len + 1`` ids (:class:`~trainer.tokens.TokenWindows`), shuffled per epoch;
- any map-style dataset (``__len__`` / ``__getitem__``: a ``datasets.Dataset``, a torch
  ``Dataset``): one example per sample (:class:`MapSamples`: a text through the tokenizer,
  or pre-tokenized ``input_ids``, cut or padded to the sample), shuffled per epoch; pack it
  into windows instead with :func:`~trainer.tokens.pack_to_file`;
- a streaming dataset with a resumable position (:class:`~trainer.stream.ResumableStream`:
  ``datasets.IterableDataset``, :class:`~trainer.stream.JsonlStream`): packed windows in
  stream order (:class:`~trainer.stream.StreamSamples`).

The reference trainer's own corpus, with nothing to download: CPython's English help
texts (``pydoc_data.topics``, about 0.47 MB) or the ``--data`` files, as UTF-8 bytes
(vocabulary 256, one byte per id). With ``--tokenizer`` (:func:`load_data`) the same files,
a ``datasets`` name or path, or a stream of them, go through that tokenizer instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.stream import JsonlStream, ResumableStream, StreamSamples
from trainer.tokens import DataError, TokenWindows, example_ids, pack_to_file, open_token_file, tokenizer_key

__all__ = [
    "DataError",
    "VOCAB_SIZE",
    "default_corpus",
    "load_corpus",
    "encode",
    "decode",
    "TokenDataset",
    "MapSamples",
    "as_samples",
    "load_tokenizer",
    "load_data",
]

log = logging.getLogger("trainer.data")

VOCAB_SIZE = 256


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
    """UTF-8 bytes as a 1-D uint8 tensor (values 0..255): one byte per id."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return bytes(values).decode("utf-8", errors="replace")



#: the reference corpus's samples: byte windows (a compact uint8 copy; the name is kept for callers)
TokenDataset = TokenWindows


class MapSamples:
    """A map-style dataset as samples, one example per sample: ``self[i]`` is
    ``(input_ids, labels)`` of example ``i``, int64 tensors of length ``seq_len``.

    An example is a text (``str`` or ``{text_key: str}``: tokenized, then the
    end-of-sequence id), pre-tokenized ``{"input_ids": [...]}`` (optionally with
    ``"labels"`` of the same length, ``-100`` where no loss is taken), or already an
    ``(input_ids, labels)`` pair of length ``seq_len``. Its ids are cut to ``seq_len + 1``
    and shifted (``labels[t]`` is the id after ``input_ids[t]``); a shorter one is padded
    (``pad_id`` in ``input_ids``, ``-100`` in ``labels``: cross-entropy skips it).

    Raises:
        ValueError: ``seq_len < 1``.
        DataError: the dataset is empty (at construction), or an example is unusable (on reading it).
    """

    __slots__ = ("dataset", "seq_len", "tokenizer", "text_key", "pad_id")

    def __init__(self, dataset: Any, seq_len: int, tokenizer: Any = None, *, text_key: str = "text",
                 pad_id: int | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(dataset) < 1:
            raise DataError("the dataset has no examples")
        self.dataset, self.seq_len, self.tokenizer, self.text_key = dataset, seq_len, tokenizer, text_key
        if pad_id is None and tokenizer is not None:
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad_id or 0)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def vocab_size(self) -> int | None:
        """Ids the tokenizer can produce (None without one)."""
        return None if self.tokenizer is None else len(self.tokenizer)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ex = self.dataset[int(i)]
        if isinstance(ex, (tuple, list)) and len(ex) == 2 and all(isinstance(t, torch.Tensor) for t in ex):
            x, y = ex
            if x.shape[-1] != self.seq_len or y.shape[-1] != self.seq_len:
                raise DataError(f"example {i}: an (input_ids, labels) pair of length {x.shape[-1]}, "
                                f"not seq_len {self.seq_len}")
            return x.long(), y.long()
        ids = example_ids(ex, self.tokenizer, text_key=self.text_key)[: self.seq_len + 1]
        labels = list(ex["labels"])[: self.seq_len + 1] if isinstance(ex, dict) and "labels" in ex else ids
        if len(labels) != len(ids):
            raise DataError(f"example {i}: {len(labels)} labels for {len(ids)} input_ids")
        pad = self.seq_len + 1 - len(ids)
        x = torch.tensor(ids[:-1] + [self.pad_id] * pad, dtype=torch.long)[: self.seq_len]
        y = torch.tensor(list(labels[1:]) + [-100] * pad, dtype=torch.long)[: self.seq_len]
        if len(ids) < 2:
            y[:] = -100
        return x, y

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked ``(input_ids, labels)`` of shape ``(len(indices), seq_len)``, int64."""
        pairs = [self[i] for i in indices]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def as_samples(data: Any, seq_len: int, tokenizer: Any = None, *, text_key: str = "text"
               ) -> TokenWindows | MapSamples | StreamSamples:
    """The sample source of ``data`` (see the module): token ids, a map-style dataset, a
    resumable stream, or a source already built (returned as is).

    Raises:
        TypeError: ``data`` is none of these (the message says what it lacks).
        DataError: too little data for one sample.
    """
    if isinstance(data, (TokenWindows, MapSamples, StreamSamples)):
        return data
    if isinstance(data, (torch.Tensor, np.ndarray)):
        return TokenWindows(data, seq_len)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return MapSamples(data, seq_len, tokenizer, text_key=text_key)
    if isinstance(data, ResumableStream):
        return StreamSamples(data, seq_len, tokenizer, text_key=text_key)
    raise TypeError(f"cannot train on a {type(data).__name__}: pass token ids, a map-style dataset "
                    "(__len__ and __getitem__) or a stream with state_dict() and load_state_dict()")


# --------------------------------------------------------------------------- the reference trainer's data


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The reference trainer's data flags (``--data`` is the corpus files')."""
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                   help="a transformers tokenizer (AutoTokenizer.from_pretrained); default: --model's, else bytes")
    p.add_argument("--dataset", metavar="NAME_OR_PATH",
                   help="a datasets name or path (datasets.load_dataset / load_from_disk) instead of --data files")
    p.add_argument("--dataset-split", default="train", metavar="SPLIT", help="--dataset's split (default: train)")
    p.add_argument("--text-key", default="text", metavar="FIELD", help='the examples\' text field (default: "text")')
    p.add_argument("--streaming", action="store_true",
                   help="read the data as a stream in order (no packing pass; resumes at its position)")
    p.add_argument("--token-cache", metavar="DIR",
                   help="where packed token files go (default: the node's scratch directory)")


def load_tokenizer(name_or_path: str) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path)``.

    Raises:
        DataError: it cannot be loaded (one line).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as exc:
        raise DataError(f"--tokenizer {name_or_path}: cannot load it ({_line(exc)})") from None


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _hf_dataset(args: argparse.Namespace, *, streaming: bool) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("--dataset needs the datasets package: pip install datasets") from None
    name = args.dataset
    try:
        if not streaming and (Path(name) / "dataset_info.json").is_file():
            ds = datasets.load_from_disk(name)
            return ds[args.dataset_split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(name, split=args.dataset_split, streaming=streaming)
    except Exception as exc:  # datasets raises many kinds: one line, exit 2
        raise DataError(f"--dataset {name}: cannot load split {args.dataset_split!r} ({_line(exc)})") from None


def _file_examples(paths: Sequence[str]) -> Any:
    """Examples of local files in order: each ``.jsonl`` line, each ``.txt`` file whole."""
    for p in map(Path, paths):
        if p.suffix.lower() in (".jsonl", ".ndjson"):
            yield from JsonlStream([p])
        else:
            yield _read_one(p)


def _cache_path(args: argparse.Namespace, tokenizer: Any, source: str) -> Path:
    from trainer.runtime import scratch_dir

    h = hashlib.sha256(json.dumps([source, tokenizer_key(tokenizer), args.text_key]).encode()).hexdigest()[:20]
    base = Path(args.token_cache) if args.token_cache else scratch_dir("tokens")
    return base / f"{h}.bin"


def load_data(args: argparse.Namespace) -> TokenWindows | StreamSamples:
    """The reference trainer's samples from its flags; sets ``args.vocab_size`` (the ids' range).

    - no ``--tokenizer`` (nor ``--model``): the corpus as bytes (:func:`load_corpus`);
    - ``--tokenizer`` with ``--data`` files or ``--dataset``: packed once into a token file
      (``--token-cache``; named by the data, the tokenizer and ``--text-key``, so a rank
      or a restart that finds it reads it instead), memory-mapped;
    - ``--streaming``: the same examples as a stream (:class:`~trainer.stream.JsonlStream`
      over ``--data``, or ``datasets``' ``streaming=True``), packed as read.

    Raises:
        DataError: missing or malformed data, an unloadable tokenizer or dataset.
    """
    name = args.tokenizer or getattr(args, "model", None)
    if name is None:
        if args.dataset or args.streaming:
            raise DataError("--dataset and --streaming need a tokenizer: --tokenizer NAME_OR_PATH (or --model)")
        args.vocab_size = VOCAB_SIZE
        return TokenWindows(encode(load_corpus(args.data)).numpy(), args.seq_len)
    tokenizer = load_tokenizer(name)
    args.vocab_size = len(tokenizer)
    if not args.data and not args.dataset:
        raise DataError("--tokenizer needs data: --data PATH (.txt, .jsonl) or --dataset NAME_OR_PATH")
    if args.streaming:
        stream = _hf_dataset(args, streaming=True) if args.dataset else JsonlStream(args.data)
        return as_samples(stream, args.seq_len, tokenizer, text_key=args.text_key)
    if args.dataset:
        ds = _hf_dataset(args, streaming=False)
        source = f"datasets:{args.dataset}:{args.dataset_split}:{getattr(ds, '_fingerprint', '')}"
        examples: Any = (ds[i] for i in range(len(ds)))
    else:
        paths = [Path(p).resolve() for p in args.data]
        for p in paths:
            if not p.is_file():
                raise DataError(f"data file not found: {p}")
        source = json.dumps([[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths])
        examples = _file_examples(args.data)
    path = _cache_path(args, tokenizer, source)
    if Path(f"{path}.json").is_file() and path.is_file():
        tokens = open_token_file(path)
    else:
        tokens = pack_to_file(examples, tokenizer, path, text_key=args.text_key, vocab_size=args.vocab_size)
    log.info("%d tokens (%s, %d bytes each) in %s", tokens.shape[0], tokens.dtype, tokens.dtype.itemsize, path)
    return TokenWindows(tokens, args.seq_len)
