"""The trainer's status lines and the daemon's parser agree on one set of forwarded events
(``daemon.control.reports.STATUS_EVENTS``): every line the trainer writes of those kinds
parses, and the daemon refuses the kinds the agent keeps to itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from daemon.control.reports import STATUS_EVENTS, Limits, ReportError, parse_report
from trainer.contract import StatusKind
from trainer.runtime import DistContext, StatusWriter

LIMITS = Limits(max_step=100, max_world_size=8)


def _written(tmp_path: Path, kind: StatusKind) -> dict:
    """The line the trainer's own writer appends for ``kind`` (rank 0 of a world of 2)."""
    path = tmp_path / f"{kind.value}.jsonl"
    StatusWriter(str(path), DistContext(0, 0, 2, "gloo", torch.device("cpu"), False), "att1").emit(kind.value, 7)
    return json.loads(path.read_text().splitlines()[-1])


@pytest.mark.parametrize("kind", list(StatusKind))
def test_the_daemon_takes_exactly_the_forwarded_kinds(tmp_path: Path, kind: StatusKind) -> None:
    report = {"kind": "trainer_status", "line": _written(tmp_path, kind)}
    if kind.value in STATUS_EVENTS:
        assert parse_report(report, LIMITS) is not None
    else:  # step rides the heartbeat, holding stays in the node's summary
        with pytest.raises(ReportError, match="line.event"):
            parse_report(report, LIMITS)


def test_every_forwarded_event_is_a_kind_the_trainer_writes() -> None:
    assert STATUS_EVENTS <= {k.value for k in StatusKind}
