"""The elastic API on a user's data: a map-style dataset and a stream, with a tokenizer and a
model by path (``from_pretrained``), through an in-process grow and shrink and a resume from a
commit, in real worker processes. Every global position is trained once, and each time with
the sample the data has at that position."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.ports import free_port
from lm_fixtures import save_model, save_tokenizer, tokenizer, write_docs
from test_grow import GROW_AT_FIVE, _assert_every_batch_once, _assert_same_state, _start
from trainer.checkpoint import latest_committed, open_store
from trainer.data import MapSamples
from trainer.sampler import ElasticSampler
from trainer.stream import JsonlStream
from trainer.tokens import TokenWindows, pack_to_file
from worker_procs import finish, joiner_env, member_env, status_lines

# the grow tests' job (test_grow.GROW_AT_FIVE) on the user's data (--data-kind): a grow at
# step 5, node0's notice at step 8; every sample each worker reads is recorded (position,
# input_ids, labels)
JOB = (*GROW_AT_FIVE, "--record-samples")

SEQ = 16


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("lm")
    return {"tokenizer": save_tokenizer(base / "tok"), "model": save_model(base / "model"),
            "docs": write_docs(base / "docs.jsonl", 300, lengths=(3, 8, 20))}


def _flags(lm: dict[str, Path], kind: str, tmp_path: Path) -> tuple[str, ...]:
    return ("--data-kind", kind,
            "--model", str(lm["model"]), "--tokenizer", str(lm["tokenizer"]), "--data", str(lm["docs"]),
            "--token-cache", str(tmp_path / "cache"), *(("--streaming",) if kind == "stream" else ()))


def _expected(lm: dict[str, Path], kind: str, tmp_path: Path):
    """Position -> (input_ids, labels) by the data alone: the stream's packing, or the
    map-style dataset's example at the sampler's index (seed 0)."""
    if kind == "stream":
        packed = TokenWindows(pack_to_file(JsonlStream([lm["docs"]]), tokenizer(), tmp_path / "ref.bin"), SEQ)
        return lambda p: tuple(t.tolist() for t in packed[p % len(packed)])
    rows = [json.loads(line) for line in lm["docs"].read_text().splitlines()]
    samples, order = MapSamples(rows, SEQ, tokenizer()), ElasticSampler(len(rows), 0)
    return lambda p: tuple(t.tolist() for t in samples[order.index(p)])


def _assert_samples_are_the_datas(tmp_path: Path, expected) -> int:
    reads = 0
    for f in tmp_path.glob("samples-*.jsonl"):
        for p, x, y in map(json.loads, f.read_text().splitlines()):
            assert (x, y) == expected(p), f"position {p} in {f.name}"
            reads += 1
    return reads


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_users_dataset_keeps_its_exact_position_through_a_grow_and_a_shrink(tmp_path: Path, rdzv, lm,
                                                                              kind: str) -> None:
    """Two workers train a model loaded by path on the user's data (a torch map-style
    Dataset of texts, or a JSONL stream); a third joins at step 5 and takes the data
    position from rank 0 (a stream's: its state at sample 5 x G); node0 leaves on a notice
    at step 8 and the other two go on. Nobody restarts; every position 0 .. 12 x G - 1 is
    trained once, every sample read is the one the data has at that position, and the
    two that finish hold the same model."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    extra = ("--join-timeout-s", "120", "--hold-timeout-s", "3", "--seq-len", str(SEQ), *_flags(lm, kind, tmp_path))
    procs = [_start(tmp_path, f"node{r}", member_env(r, 2, master, "grow"), rdzv.port, ckpt, job=JOB, extra=extra)
             for r in range(2)]
    procs.append(_start(tmp_path, "node2", joiner_env(), rdzv.port, ckpt, job=JOB, extra=extra))
    outs = finish(procs)
    assert [p.returncode for p in procs] == [1, 0, 0], "\n".join(outs)
    started = [(x["step"], x.get("resized"), x["world_size"]) for x in status_lines(tmp_path, "node1")
               if x["event"] == "started"]
    assert started == [(0, None, 2), (5, "in_process", 3), (8, "in_process", 2)], "\n".join(outs)
    _assert_every_batch_once(tmp_path, 12)
    assert _assert_samples_are_the_datas(tmp_path, _expected(lm, kind, tmp_path)) >= 12 * 12
    _assert_same_state(tmp_path, 2)


@pytest.mark.slow
def test_a_stream_resumes_from_its_commit_at_the_next_sample(tmp_path: Path, rdzv, lm) -> None:
    """A stream job stops at step 4 (committed); a new worker with another micro batch resumes it
    to step 8 from the stream state in the commit: positions 4 x G on, each the data's sample,
    none read twice."""
    extra = ("--seq-len", str(SEQ), *_flags(lm, "stream", tmp_path))
    ckpt = (tmp_path / "ckpt").as_uri()
    first = _start(tmp_path, "node0", member_env(0, 1, free_port(), "resume"), rdzv.port, ckpt, job=JOB, joiners=0,
                   extra=(*extra, "--target-steps", "4"))
    assert finish([first]) and first.returncode == 0
    position = latest_committed(open_store(ckpt)).data_position
    assert position["consumed_samples"] == 4 * 12 and position["stream"]["position"] == 4 * 12
    second = _start(tmp_path, "node1", member_env(0, 1, free_port(), "resume"), rdzv.port, ckpt, job=JOB,
                    joiners=0,
                    extra=(*extra, "--target-steps", "8", "--global-batch-size", "12", "--micro-batch-size", "3"))
    out = finish([second])
    assert second.returncode == 0, out
    assert [x["resumed_from"] for x in status_lines(tmp_path, "node1") if x["event"] == "started"] == [4]
    _assert_every_batch_once(tmp_path, 8)
    second_reads = [json.loads(x)[0] for x in (tmp_path / "samples-node1.jsonl").read_text().splitlines()]
    assert sorted(second_reads) == list(range(4 * 12, 8 * 12))  # nothing re-read from the start
    assert _assert_samples_are_the_datas(tmp_path, _expected(lm, "stream", tmp_path)) == 8 * 12
    assert np.all(np.diff(second_reads) > 0)
    # the resumed worker tokenized the examples of steps 5 .. 8 only (plus the one it resumed
    # inside): it did not read the stream from its start to find sample 4 x G
    first_examples, second_examples = (int((tmp_path / f"examples-{node}").read_text()) for node in ("node0", "node1"))
    assert second_examples <= 1.2 * first_examples + 1, (first_examples, second_examples)
