"""The directory commit protocol (write_dir / fetch_dir / DirCheckpointer) on file:// and S3 (moto)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import new_bucket
from trainer.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    FileStore,
    S3Store,
    ShardInfo,
    fetch_dir,
    latest_committed,
    scan,
    step_dir,
    write_dir,
)
from trainer.guard import Decision, PreemptionGuard
from trainer.integrations.common import DirCheckpointer, merge_shards
from trainer.runtime import DistContext, StatusWriter


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return FileStore((tmp_path / "store").as_uri())
    endpoint = request.getfixturevalue("s3_server")
    # A 5 MiB threshold so the 6 MiB file below really goes up as a multipart upload.
    return S3Store(f"s3://{new_bucket(endpoint, 'dir')}/job", endpoint_url=endpoint, multipart_threshold=5 * 2**20,
                   multipart_chunksize=5 * 2**20)


def _framework_save(folder):
    """What a framework leaves: nested files, one larger than a multipart part, a temp file."""
    (folder / "global_step3").mkdir(parents=True)
    (folder / "latest").write_text("global_step3")
    (folder / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 24576)  # 6 MiB
    (folder / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optim" * 100)
    (folder / "global_step3" / ".half.tmp-x").write_bytes(b"partial")


def _solo(tmp_path, store):
    ctx = DistContext(0, 0, 1, None, torch.device("cpu"), False)
    status = tmp_path / "status.jsonl"
    return DirCheckpointer(ctx, store, tmp_path / "scratch", StatusWriter(str(status), ctx, "a1"),
                           PreemptionGuard(None), keep=2), status


def test_dir_round_trip_keeps_every_byte_and_skips_temp_files(store, tmp_path):
    src = tmp_path / "src"
    _framework_save(src)
    shards = write_dir(store, 3, src, prefix="ds/")
    assert sorted(s.name for s in shards) == [
        "ds/global_step3/mp_rank_00_model_states.pt",
        "ds/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "ds/latest",
    ]
    ckpt, _ = _solo(tmp_path, store)
    result = ckpt.commit(3, lambda d: _framework_save(d), reason="periodic", decision=None,
                         global_batch_size=8, data_position={"consumed_samples": 24})
    assert result.bytes == 6 * 2**20 + 500 + len("global_step3")
    manifest, local = ckpt.fetch_latest()
    assert manifest.step == 3 and manifest.extra["reason"] == "periodic"
    assert {"save_s", "upload_s"} <= set(manifest.extra)
    assert (local / "global_step3" / "mp_rank_00_model_states.pt").read_bytes() == bytes(range(256)) * 24576
    assert (local / "latest").read_text() == "global_step3"
    assert not (local / "global_step3" / ".half.tmp-x").exists()


def test_commit_writes_the_status_line_the_agent_waits_for(store, tmp_path):
    ckpt, status = _solo(tmp_path, store)
    decision = Decision(checkpoint=True, hold=True, notice_ids=("n-1",), kinds=("interruption",))
    ckpt.commit(5, _framework_save, reason="notice", decision=decision, global_batch_size=8,
                data_position={"consumed_samples": 40})
    line = json.loads(status.read_text().splitlines()[-1])
    assert line["event"] == "checkpoint_committed" and line["notice_ids"] == ["n-1"] and line["step"] == 5
    # Committing the same step again (resumed there) saves nothing and still answers the agent.
    ckpt.commit(5, lambda d: pytest.fail("saved twice"), reason="final", decision=None, global_batch_size=8,
                data_position={"consumed_samples": 40})
    assert json.loads(status.read_text().splitlines()[-1])["reused"] is True
    assert latest_committed(store).extra["notice_ids"] == ["n-1"]


def test_a_torn_upload_is_never_resumed_from(store, tmp_path):
    ckpt, _ = _solo(tmp_path, store)
    ckpt.commit(3, _framework_save, reason="periodic", decision=None, global_batch_size=8,
                data_position={"consumed_samples": 24})

    def killed_mid_upload(folder):
        _framework_save(folder)
        raise CheckpointError("upload killed")

    with pytest.raises(CheckpointError):
        ckpt.commit(6, killed_mid_upload, reason="periodic", decision=None, global_batch_size=8,
                    data_position={"consumed_samples": 48})
    # Half the files of step 6 reached the store, but no manifest: resume takes step 3.
    write_dir(store, 6, tmp_path / "scratch" / "save-00000006")
    assert [d.step for d in scan(store) if not d.committed] == [6]
    fresh, _ = _solo(tmp_path, store)
    assert fresh.fetch_latest()[0].step == 3


def test_a_corrupt_shard_is_discarded_and_the_previous_checkpoint_taken(store, tmp_path):
    ckpt, _ = _solo(tmp_path, store)
    for step in (3, 6):
        ckpt.commit(step, _framework_save, reason="periodic", decision=None, global_batch_size=8,
                    data_position={"consumed_samples": 8 * step})
    key = f"{step_dir(6)}/latest"
    store.put_bytes(key, b"global_stepX")  # same size, other bytes: only the sha256 tells
    with pytest.raises(CorruptCheckpointError):
        fetch_dir(store, latest_committed(store), tmp_path / "probe")
    manifest, _ = _solo(tmp_path, store)[0].fetch_latest()
    assert manifest.step == 3
    assert [d.step for d in scan(store)] == [3]


def test_two_nodes_writing_one_name_differently_is_refused():
    a = ShardInfo.of("config.json", b"{}")
    assert merge_shards([[a], [a]]) == (a,)
    with pytest.raises(CheckpointError, match="config.json"):
        merge_shards([[a], [ShardInfo.of("config.json", b"[]")]])
