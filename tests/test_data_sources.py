"""The elastic data path with a tokenizer (trainer/tokens.py, trainer/stream.py, trainer/data.py):
sample ``p`` is one sample, whether packed into a file or read off a stream, at any world size
and after any resize; ids are held in the smallest dtype, memory-mapped."""

from __future__ import annotations

import argparse
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_fixtures import VOCAB, save_model, save_tokenizer, tokenizer, write_docs
from trainer.batch import ElasticBatch
from trainer.data import MapSamples, TokenDataset, as_samples, encode, load_data
from trainer.run import build_parser
from trainer.sampler import ElasticSampler
from trainer.stream import JsonlStream, StreamSamples
from trainer.tokens import DataError, TokenWindows, pack_to_file, token_dtype


class ListStream:
    """A resumable stream over a list (the protocol's smallest implementation): state = next index."""

    def __init__(self, items: list) -> None:
        self.items, self.i = items, 0

    def __iter__(self):
        while self.i < len(self.items):
            self.i += 1
            yield self.items[self.i - 1]

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


def _flat(docs: list[list[int]]) -> np.ndarray:
    return np.array([i for d in docs for i in d], dtype=np.int64)


def _reference(docs: list[list[int]], seq_len: int, p: int) -> list[int]:
    """Sample ``p`` by the packing rule: window p of the concatenation, repeated per epoch."""
    flat = _flat(docs)
    w = seq_len + 1
    ids = np.concatenate([flat] * (((p + 1) * w) // len(flat) + 1))
    return ids[p * w:(p + 1) * w].tolist()


def test_token_dtype_is_the_smallest_that_holds_the_vocabulary() -> None:
    assert [token_dtype(v) for v in (2, 256, 257, 65536, 65537, 2**32)] == [
        np.uint8, np.uint8, np.uint16, np.uint16, np.uint32, np.uint32]
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


docs_st = st.lists(st.lists(st.integers(0, 999), min_size=0, max_size=30), min_size=1, max_size=12).filter(
    lambda d: sum(map(len, d)) >= 1)


@settings(max_examples=150, deadline=None)
@given(docs=docs_st, seq_len=st.integers(1, 9), reads=st.lists(st.integers(0, 40), min_size=1, max_size=12),
       resume_at=st.integers(0, 40))
def test_packing_is_deterministic_and_position_addressable(tmp_path_factory, docs, seq_len, reads, resume_at) -> None:
    """Pre-tokenized documents packed into a file and read off a stream give sample ``p`` the
    same ids, in any order of reads (back and forth), and after restoring the stream at the
    state it had at any other position (a commit's, a joiner's)."""
    examples = [{"input_ids": d} for d in docs]
    path = tmp_path_factory.mktemp("pack") / "t.bin"
    tokens = pack_to_file(examples, None, path, vocab_size=1000)
    assert tokens.dtype == np.uint16 and tokens.tolist() == _flat(docs).tolist()
    if len(tokens) < seq_len + 1:
        with pytest.raises(DataError, match="fewer than seq_len"):
            TokenWindows(tokens, seq_len)
    else:
        packed = TokenWindows(tokens, seq_len)
        for p in range(len(packed)):
            x, y = packed[p]
            assert x.tolist() + y.tolist()[-1:] == _reference(docs, seq_len, p)
    stream = StreamSamples(ListStream(examples), seq_len)
    stream.set_mark_every(4)
    for p in reads:  # forward and back: back restarts from a mark, or from the start
        x, y = stream.batch([p])
        assert x[0].tolist() + y[0].tolist()[-1:] == _reference(docs, seq_len, p)
    state = json.loads(json.dumps(stream.state_at(resume_at)))  # as a manifest stores it
    other = StreamSamples(ListStream(examples), seq_len)
    other.restore(state)
    for p in range(resume_at, resume_at + 5):
        x, y = other.batch([p])
        assert x[0].tolist() + y[0].tolist()[-1:] == _reference(docs, seq_len, p)


def test_text_packing_ends_each_document_with_eos(tmp_path: Path) -> None:
    tok = tokenizer()
    texts = ["the cat", "sat on the mat", "and so on"]
    tokens = pack_to_file(texts, tok, tmp_path / "t.bin")
    expected = [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert tokens.tolist() == expected
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16  # 320 ids: 2 bytes each
    assert (tmp_path / "t.bin").stat().st_size == 2 * len(expected)


def _history(stream: StreamSamples, batch: ElasticBatch, history: list[tuple[int, int]], *,
             redo: set[int] = frozenset()) -> dict[int, list[list[int]]]:
    """Positions -> the ids read for them, rank by rank as the loop reads (one sample cursor per
    rank is modelled by one cursor going through every rank's reads in turn, which only adds
    back-seeks); a step in ``redo`` is read twice (trained again after a peer was lost)."""
    seen: dict[int, list[list[int]]] = {}
    step = 0
    for world, steps in history:
        plan = batch.plan(world)
        for _ in range(steps):
            for _attempt in range(2 if step in redo else 1):
                for rank in range(world):
                    for mb in ElasticSampler.positions_for(step, plan, rank):
                        x, y = stream.batch(mb)
                        for p, a, b in zip(mb, x, y):
                            seen.setdefault(p, []).append(a.tolist() + b.tolist()[-1:])
            step += 1
    return seen


def test_a_stream_keeps_the_exact_position_through_resizes(tmp_path: Path) -> None:
    """A world-size history 3 -> 2 -> 6 -> 1 with a step trained twice (a peer lost without
    notice): every position of every step is read, each time with the ids the packed file
    has for it."""
    tok = tokenizer()
    docs = write_docs(tmp_path / "d.jsonl", 60)
    packed = TokenWindows(pack_to_file(JsonlStream([docs]), tok, tmp_path / "t.bin"), 8)
    stream = StreamSamples(JsonlStream([docs]), 8, tok)
    batch = ElasticBatch(12, 2)
    stream.set_mark_every(12)
    history = [(3, 3), (2, 2), (6, 2), (1, 2)]
    seen = _history(stream, batch, history, redo={4})
    steps = sum(n for _, n in history)
    assert sorted(seen) == list(range(steps * 12))
    for p, reads in seen.items():
        x, y = packed[p % len(packed)]
        assert reads == [x.tolist() + y.tolist()[-1:]] * len(reads), p
    assert len(seen[4 * 12]) == 2  # step 4 was read twice, the same both times


def test_a_stream_wraps_to_its_next_epoch(tmp_path: Path) -> None:
    docs = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    s = StreamSamples(ListStream(docs), 3)
    got = [s.batch([p])[0][0].tolist() for p in range(4)]
    assert got == [[1, 2, 3], [5, 1, 2], [4, 5, 1], [3, 4, 5]]
    assert s.state()["epoch"] == 3
    with pytest.raises(DataError, match="no tokens"):
        StreamSamples(ListStream([{"input_ids": []}]), 3).batch([0])


def test_jsonl_stream_resumes_at_its_byte_offset(tmp_path: Path) -> None:
    a = tmp_path / "a.jsonl"
    a.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    b = tmp_path / "b.txt"
    b.write_text("three\nfour\n")
    s = JsonlStream([a, b])
    it = iter(s)
    assert next(it) == {"text": "one"}
    state = s.state_dict()
    assert [*it] == [{"text": "two"}, "three", "four"]
    s.load_state_dict(state)
    assert [*s] == [{"text": "two"}, "three", "four"]
    with pytest.raises(DataError, match="not found"):
        JsonlStream([tmp_path / "missing.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DataError, match="bad.jsonl at byte 0: not JSON"):
        list(JsonlStream([bad]))


class TextDataset(torch.utils.data.Dataset):
    """A user's torch Dataset: dicts with a text and something else."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict:
        return {"text": self.texts[i], "source": "x"}


def test_a_map_style_dataset_is_one_example_per_sample() -> None:
    tok = tokenizer()
    samples = as_samples(TextDataset(["the cat sat on the mat and the dog", "a"]), 4, tok)
    assert isinstance(samples, MapSamples) and len(samples) == 2 and samples.vocab_size == VOCAB
    x, y = samples.batch([0, 1])
    ids = tok("the cat sat on the mat and the dog", add_special_tokens=False)["input_ids"]
    assert x[0].tolist() == ids[:4] and y[0].tolist() == ids[1:5]  # cut to seq_len + 1, shifted
    a = tok("a", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert x[1].tolist() == a[:-1] + [tok.pad_token_id] * (5 - len(a))  # padded
    assert y[1].tolist() == a[1:] + [-100] * (5 - len(a))  # no loss on the padding
    pre = as_samples([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}], 4)
    x, y = pre[0]
    assert x.tolist() == [5, 6, 0, 0] and y.tolist() == [6, 7, -100, -100]
    with pytest.raises(DataError, match='no "text" text'):
        as_samples([{"body": "x"}], 4, tok)[0]
    with pytest.raises(TypeError, match="state_dict"):
        as_samples(iter([1, 2]), 4)


def test_held_bytes_per_token(tmp_path: Path) -> None:
    """A packed file of 2-byte ids is mapped, not loaded: opening it and reading a step's
    samples allocates a few KB, whatever its size. The byte corpus is 1 byte per byte of
    text (it was an int64 tensor: 8)."""
    n = 4_000_000
    ids = (np.arange(n, dtype=np.int64) % VOCAB).tolist()
    path = tmp_path / "big.bin"
    pack_to_file([{"input_ids": ids[i:i + 100_000]} for i in range(0, n, 100_000)], None, path, vocab_size=VOCAB)
    del ids
    assert path.stat().st_size == 2 * n
    from trainer.tokens import open_token_file

    tracemalloc.start()
    windows = TokenWindows(open_token_file(path), 64)
    windows.batch(list(range(0, 12 * 997, 997)))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024, f"{peak} bytes held for a {2 * n} byte token file"
    corpus = TokenDataset(encode("x" * 10_000), 16)
    assert corpus.tokens.dtype == np.uint8 and corpus.tokens.nbytes == 10_000


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["--checkpoint-uri", (tmp_path / "ck").as_uri(), "--seq-len", "16",
                                      "--target-steps", "1", "--token-cache", str(tmp_path / "cache"), *extra])


def test_load_data_packs_once_with_the_tokenizer_and_reads_the_cache_after(tmp_path: Path) -> None:
    tok_dir = save_tokenizer(tmp_path / "tok")
    docs = write_docs(tmp_path / "d.jsonl", 30)
    args = _args(tmp_path, "--tokenizer", str(tok_dir), "--data", str(docs))
    first = load_data(args)
    assert args.vocab_size == VOCAB and first.tokens.dtype == np.uint16 and isinstance(first.tokens, np.memmap)
    cached = list((tmp_path / "cache").glob("*.bin"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    second = load_data(_args(tmp_path, "--tokenizer", str(tok_dir), "--data", str(docs)))
    assert cached[0].stat().st_mtime_ns == mtime and np.array_equal(first.tokens, second.tokens)
    stream = load_data(_args(tmp_path, "--tokenizer", str(tok_dir), "--data", str(docs), "--streaming"))
    assert isinstance(stream, StreamSamples)
    assert [stream.batch([p])[0].tolist() for p in range(5)] == [first.batch([p])[0].tolist() for p in range(5)]


@pytest.mark.parametrize("flags, message", [
    (["--streaming"], "--dataset and --streaming need a tokenizer"),
    (["--tokenizer", "{tok}"], "--tokenizer needs data"),
    (["--tokenizer", "{tmp}/nowhere"], "--tokenizer {tmp}/nowhere: cannot load it"),
])
def test_load_data_refuses_in_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    tok = save_tokenizer(tmp_path / "tok")
    fill = {"tok": str(tok), "tmp": str(tmp_path)}
    with pytest.raises(DataError) as err:
        load_data(_args(tmp_path, *[f.format(**fill) for f in flags]))
    assert message.format(**fill) in str(err.value) and "\n" not in str(err.value)


def test_from_pretrained_model_is_checked_against_the_tokenizer_and_seq_len(tmp_path: Path) -> None:
    from trainer.loop import ConfigError
    from trainer.run import build_model

    model_dir = save_model(tmp_path / "m", n_positions=32)
    args = _args(tmp_path, "--model", str(model_dir))
    args.vocab_size = VOCAB
    model = build_model(args)
    assert model.get_input_embeddings().num_embeddings == VOCAB
    args.vocab_size = VOCAB + 1
    with pytest.raises(ConfigError, match="embeds 320 ids, the tokenizer has 321"):
        build_model(args)
    args.vocab_size, args.seq_len = VOCAB, 33
    with pytest.raises(ConfigError, match="--seq-len 33 is longer than .* 32 positions"):
        build_model(args)
