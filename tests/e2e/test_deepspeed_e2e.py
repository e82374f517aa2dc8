"""End to end: ``spotvisord demo`` on configs/local-deepspeed.yaml (the DeepSpeed ZeRO-2
example trainer under real torchrun elastic, real agents and IMDSv2 endpoints).

World 3 -> an interruption notice -> the survivors resume at 2 through DeepSpeed's
universal checkpoint -> the replacement joins -> 3 again. Asserts every step done, no
step lost on the notice, no sample repeated or skipped, and a loss that carries on
from where it was before the preemption.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _status_lines(tmp_path: Path) -> list[dict]:
    lines = []
    for path in sorted((tmp_path / "state").glob("demo-*/nodes/*/status.jsonl")):
        lines += [json.loads(raw) for raw in path.read_text().splitlines() if raw.strip()]
    return sorted(lines, key=lambda s: s["time"])


def test_deepspeed_demo_shrinks_through_universal_checkpoint_and_grows_back(run_config_demo, tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "configs" / "local-deepspeed.yaml").read_text())
    job = raw["job"]
    # As shipped: the replacement is held until the job has trained 5 steps at world size 2.
    s = run_config_demo("configs/local-deepspeed.yaml", timeout_s=300)

    assert s["steps_completed"] == s["target_steps"] == job["target_steps"]
    assert s["lost_steps_on_notice"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    assert s["preemptions_with_notice"] == 1
    ws = s["world_sizes"]
    assert ws[:1] == [3] and ws[-1] == 3 and 2 in ws, ws

    status = _status_lines(tmp_path)
    loads = [x for x in status if x["event"] == "checkpoint_loaded"]
    shrink = [x for x in loads if x["world_size"] == 2]
    assert shrink and all(x["universal"] and x["saved_world_size"] == 3 for x in shrink), loads
    notice_commit = next(x for x in status if x["event"] == "checkpoint_committed" and x["reason"] == "notice")
    resumed = notice_commit["step"]
    assert shrink[0]["step"] == resumed
    # The job trained at world size 2, and growing back loaded that world-2 commit at 3,
    # again through a universal checkpoint (2 -> 3).
    assert any(x["event"] == "step" and x["world_size"] == 2 for x in status)
    grow = [x for x in loads if x["world_size"] == 3 and x["step"] > resumed]
    assert grow and grow[0]["universal"] and grow[0]["saved_world_size"] == 2, loads

    # Loss: the final lineage's steps just after the resume are not worse than just before it.
    last: dict[int, float] = {}
    for x in status:
        if x["event"] == "step":
            last[x["step"]] = x["loss"]  # later attempts overwrite: the lineage
    before = mean(last[k] for k in range(resumed - 2, resumed + 1))
    after = mean(last[k] for k in range(resumed + 1, resumed + 4))
    assert after <= before * 1.05, (before, after)
    assert s["loss_last"] < s["loss_first"]
