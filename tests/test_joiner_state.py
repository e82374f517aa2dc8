"""A joiner of a sharded job allocates nothing of the model before it is admitted: every
value comes from its peers in the resize, which allocates only its shards (at 7 B the
whole model it would otherwise build, initialise and drop is 28 GB of host memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.batch import ElasticBatch
from trainer.contract import JOIN_ENV
from trainer.data import as_samples, load_data
from trainer.integrations.meta import on_meta
from trainer.runtime import joiner_context

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "8", "--global-batch-size", "2",
        "--micro-batch-size", "1", "--target-steps", "2"]


def _job(tmp_path: Path, *flags: str, deepspeed: bool = False):
    if deepspeed:
        from trainer.examples.deepspeed_zero2 import DeepSpeedJob as Job
        from trainer.examples.deepspeed_zero2 import build_parser
    else:
        from trainer.examples.fsdp_dcp import DcpJob as Job
        from trainer.examples.fsdp_dcp import build_parser
    data = tmp_path / "corpus.txt"
    data.write_text("spot instances come and go; the job goes on. " * 20)
    args = build_parser().parse_args(["--checkpoint-uri", (tmp_path / "ckpt").as_uri(), "--data", str(data),
                                      *TINY, *flags])
    plan = ElasticBatch(args.global_batch_size, args.micro_batch_size).plan(1)
    return Job(args, joiner_context(), plan, as_samples(load_data(args), args.seq_len))


@pytest.mark.parametrize("deepspeed", [False, True], ids=["fsdp", "deepspeed"])
@pytest.mark.parametrize("joins", [True, False], ids=["joiner", "first"])
def test_a_sharded_jobs_joiner_builds_its_model_on_the_meta_device(tmp_path: Path, monkeypatch, joins: bool,
                                                                   deepspeed: bool) -> None:
    monkeypatch.setenv(JOIN_ENV, "1" if joins else "0")
    job = _job(tmp_path, deepspeed=deepspeed)
    try:
        assert on_meta(job.state.model) is joins
        assert all(p.device == torch.device("meta" if joins else "cpu") for p in job.state.model.parameters())
    finally:
        job.close()


def test_a_replicated_jobs_joiner_takes_an_allocated_model(tmp_path: Path, monkeypatch) -> None:
    """DDP's joiner loads the whole state rank 0 sends into its own model: it must exist."""
    monkeypatch.setenv(JOIN_ENV, "1")
    job = _job(tmp_path, "--wrap", "ddp")
    try:
        assert not on_meta(job.state.model)
    finally:
        job.close()
