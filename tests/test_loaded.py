"""``trainer.loop.loaded``: where a framework's resume leaves the job. A sharded job whose
peer was lost before anything was committed reloads nothing: its fresh model is of step
0, so its step and its data position must be too (before, the survivors went on at the
step they had reached with a freshly initialised model: FSDP2 trained on silently,
DeepSpeed failed its step-count check)."""

from __future__ import annotations

from types import SimpleNamespace

from trainer.loop import loaded


def _job(step: int) -> SimpleNamespace:
    calls: list = []
    job = SimpleNamespace(ctx=SimpleNamespace(is_leader=False), state=SimpleNamespace(step=step),
                          store=SimpleNamespace(uri="file:///x"), status=SimpleNamespace(emit=lambda *a, **k: None),
                          start_data=calls.append, last_committed="old", committed_step=3)
    job.calls = calls
    return job


def test_nothing_committed_puts_the_job_at_step_0_whatever_step_it_had_reached() -> None:
    job = _job(5)
    loaded(job, None, None)
    assert (job.state.step, job.last_committed, job.committed_step, job.calls) == (0, None, None, [None])


def test_a_commit_puts_the_job_at_its_step_and_data_position() -> None:
    job = _job(9)
    manifest = SimpleNamespace(step=4, data_position={"epoch": 0, "index": 48})
    loaded(job, manifest, {"fetch_s": 0.1})
    assert (job.state.step, job.committed_step, job.calls) == (4, 4, [{"epoch": 0, "index": 48}])
