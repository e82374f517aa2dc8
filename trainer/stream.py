"""Streaming data with a position: sample ``p`` of a stream, at any world size, after any resize.

A streaming dataset has no length and no random access; what makes it usable by an
elastic job is a *resumable position*. The contract (:class:`ResumableStream`) is the
one ``datasets.IterableDataset`` (``datasets >= 2.18``) and torchdata's stateful
loaders follow:

- ``iter(stream)`` yields examples in a fixed order;
- ``stream.state_dict()``, called between two examples of an iteration (or before the
  first), returns where the next example comes from: a JSON-serialisable dict;
- ``stream.load_state_dict(state)`` followed by ``iter(stream)`` yields from there.

:class:`JsonlStream` is one over local ``.jsonl`` / ``.txt`` files (the state is a file
number and a byte offset). :class:`StreamSamples` packs a stream's examples into
fixed-length samples exactly as :mod:`trainer.tokens` packs a file, and addresses them
by global sample position: its state at position ``p`` is the stream's state before the
example that sample ``p`` starts in, plus the offset into that example's ids. That state
goes into a commit's ``data_position`` (a resume from the commit reads nothing twice)
and to a joining worker (it starts reading where the group is).

Sample order: the stream's order, not shuffled (a stream's own shuffle buffer is not
part of its state in ``datasets``: shuffle upstream, or shard in a fixed order). When
the stream ends, the next epoch starts it again from its first state.

Cost: every rank reads and tokenizes the stream up to its own samples (the samples of
the lower ranks are packed and dropped), as ``datasets.distributed.split_dataset_by_node``
does for a stream it cannot split by shards: tokenizing ``G * seq_len`` ids per step
on each rank, against a forward and backward pass over ``G * seq_len / W`` of them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from trainer.tokens import DataError, example_ids

__all__ = ["ResumableStream", "JsonlStream", "StreamSamples"]

#: step-start states a stream keeps for going back (a step redone after a peer was lost)
MARKS_KEPT = 8


@runtime_checkable
class ResumableStream(Protocol):
    """An iterable of examples that can say where it is and go back there (see the module)."""

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class JsonlStream:
    """Examples read lazily off local files, in order: a ``.jsonl`` line is one example
    (a JSON object), a ``.txt`` line one text (blank lines skipped). State:
    ``{"file": i, "offset": byte offset}``; memory: one line.

    Raises:
        DataError: at construction, a file is missing; while iterating, a line is not JSON.
    """

    __slots__ = ("paths", "_file", "_offset")

    def __init__(self, paths: Sequence[str | Path]) -> None:
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise DataError("a stream needs at least one data file (--data PATH)")
        for p in self.paths:
            if not p.is_file():
                raise DataError(f"data file not found: {p}")
        self._file, self._offset = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"file": self._file, "offset": self._offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._file, self._offset = int(state["file"]), int(state["offset"])

    def __iter__(self) -> Iterator[Any]:
        while self._file < len(self.paths):
            path = self.paths[self._file]
            jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
            with open(path, "rb") as f:
                f.seek(self._offset)
                while line := f.readline():
                    start = self._offset
                    self._offset = f.tell()  # before the yield: state_dict() then names the next line
                    text = line.decode("utf-8", errors="replace").strip()
                    if not text:
                        continue
                    if not jsonl:
                        yield text
                        continue
                    try:
                        yield json.loads(text)
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{path} at byte {start}: not JSON ({exc.msg})") from None
            self._file, self._offset = self._file + 1, 0


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as exc:
        raise DataError(f"the stream's state_dict() is not JSON-serialisable ({exc}): "
                        "a commit could not record the data position") from None


class StreamSamples:
    """Fixed-length samples read off a :class:`ResumableStream`, addressed by global position.

    ``batch(positions)`` returns the samples at those positions (any order; cheapest
    ascending, as the loop asks). Going forward reads on; going back (a step trained
    again after a peer was lost) restarts from the nearest step-start mark at or before
    the position (``mark_every``: the global batch size, set by the job) and reads on.

    Args:
        stream: the examples (texts, ``{text_key: ...}`` or pre-tokenized ``{"input_ids": ...}``).
        seq_len: ids per sample (``input_ids`` and ``labels`` each).
        tokenizer: a ``transformers`` tokenizer, or None for pre-tokenized examples.

    Raises:
        TypeError: ``stream`` lacks ``state_dict`` / ``load_state_dict``.
        ValueError: ``seq_len < 1``.
    """

    def __init__(self, stream: Any, seq_len: int, tokenizer: Any = None, *, text_key: str = "text") -> None:
        if not isinstance(stream, ResumableStream):
            raise TypeError(f"{type(stream).__name__} is not a resumable stream: it needs __iter__, state_dict() "
                            "and load_state_dict() (datasets.IterableDataset has them from datasets 2.18)")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.stream, self.seq_len, self.tokenizer, self.text_key = stream, seq_len, tokenizer, text_key
        self.mark_every = 0  # 0: no marks (set_mark_every)
        self._first = _copy_state(stream.state_dict())
        self._marks: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.examples_read = 0  # how many examples this rank tokenized (for the cost figure)
        self.restore(self.initial_state())

    @property
    def vocab_size(self) -> int | None:
        """Ids the tokenizer can produce (None without one)."""
        return None if self.tokenizer is None else len(self.tokenizer)

    def initial_state(self) -> dict[str, Any]:
        return {"position": 0, "epoch": 0, "stream": self._first, "offset": 0}

    def set_mark_every(self, samples: int) -> None:
        """Keep the state at every multiple of ``samples`` (the global batch) passed."""
        self.mark_every = max(0, int(samples))
        self._marks.clear()

    # -- the cursor: the example being read and the offset of the next id in it

    def restore(self, state: dict[str, Any]) -> None:
        """Put the cursor at ``state`` (:meth:`state`'s, from this stream's data).

        Raises:
            DataError: ``state`` is malformed or the stream ends before its offset.
        """
        try:
            pos, epoch, offset = int(state["position"]), int(state["epoch"]), int(state["offset"])
            inner = _copy_state(state["stream"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise DataError(f"not a stream position: {str(state)[:120]}") from None
        self._pos, self._epoch = pos, epoch
        self._load(inner)
        self._ex_state = inner
        self._ids: list[int] = []
        self._k = 0
        self._epoch_ids = None if pos else 0  # ids this epoch yielded (None: not known, after a restore)
        if offset:
            self._next_example(wrap=False)
            if offset > len(self._ids):
                raise DataError(f"stream position {pos}: offset {offset} beyond its example's {len(self._ids)} ids")
            self._k = offset

    def _load(self, inner: dict[str, Any]) -> None:
        self.stream.load_state_dict(_copy_state(inner))
        self._it = iter(self.stream)
        # the state before the next example is the one loaded (a stream need not report it
        # before its iteration has started: datasets' does not)
        self._loaded: dict[str, Any] | None = inner

    def state(self) -> dict[str, Any]:
        """Where the cursor is: ``{"position", "epoch", "stream", "offset"}`` (JSON)."""
        return {"position": self._pos, "epoch": self._epoch, "stream": self._ex_state, "offset": self._k}

    def _next_example(self, *, wrap: bool = True) -> None:
        while True:
            state = self._loaded if self._loaded is not None else _copy_state(self.stream.state_dict())
            self._loaded = None
            try:
                ex = next(self._it)
                break
            except StopIteration:
                if not wrap:
                    raise DataError("the stream ended before a recorded position: the data changed") from None
                if self._epoch_ids == 0:
                    raise DataError("the stream yields no tokens") from None
                self._epoch, self._epoch_ids = self._epoch + 1, 0  # the next epoch: start it again
                self._load(self._first)
        self._ex_state = state
        self._ids = example_ids(ex, self.tokenizer, text_key=self.text_key)
        self._k = 0
        if self._epoch_ids is not None:
            self._epoch_ids += len(self._ids)
        self.examples_read += 1

    def _take(self, keep: bool) -> np.ndarray | None:
        """The next sample's ``seq_len + 1`` ids (None when not ``keep``); the cursor moves on."""
        if self.mark_every and self._pos % self.mark_every == 0 and self._pos not in self._marks:
            self._marks[self._pos] = self.state()
            while len(self._marks) > MARKS_KEPT:
                self._marks.popitem(last=False)
        need, parts = self.seq_len + 1, []
        while need:
            if self._k >= len(self._ids):
                self._next_example()
                continue
            n = min(need, len(self._ids) - self._k)
            if keep:
                parts.append(self._ids[self._k:self._k + n])
            self._k += n
            need -= n
        self._pos += 1
        return np.fromiter((i for p in parts for i in p), dtype=np.int64, count=self.seq_len + 1) if keep else None

    def seek(self, position: int) -> None:
        """Move the cursor to ``position`` (back to a mark first if it is behind)."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if position < self._pos:
            marks = [p for p in self._marks if p <= position]
            self.restore(self._marks[max(marks)] if marks else self.initial_state())
        while self._pos < position:
            self._take(keep=False)

    def state_at(self, position: int) -> dict[str, Any]:
        """The state at global sample ``position`` (for a commit's data position, or a joiner)."""
        self.seek(position)
        return self.state()

    def sample(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seek(position)
        w = torch.from_numpy(self._take(keep=True))
        return w[:-1], w[1:]

    def batch(self, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked ``(input_ids, labels)`` of shape ``(len(positions), seq_len)``, int64."""
        pairs = {p: self.sample(p) for p in sorted(positions)}
        return torch.stack([pairs[p][0] for p in positions]), torch.stack([pairs[p][1] for p in positions])
