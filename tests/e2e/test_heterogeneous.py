"""End to end: nodes with different GPU counts in one job (issue 5, item 5).

Two local offers: a 2-"GPU" node (two worker processes, cheaper per GPU) and a
1-GPU node. The pool fills a world of 3 with one of each (2 + 2 = 4 is not a valid
world size for a global batch of 12 with micro batch 2; 2 + 1 = 3 is), so torchrun
runs ``--nproc-per-node`` 2 on one node and 1 on the other: world size 3 = the sum.
The 2-GPU node is then preempted with notice: the job goes on at world size 1 with
the same global batch (6 micro batches of accumulation) and grows back to 3.
"""

from __future__ import annotations

import pytest

from e2e.conftest import paced

pytestmark = pytest.mark.slow

OFFERS = [
    {"provider": "local", "region": "local", "zone": "local-a", "instance_type": "local.cpu2",
     "gpus_per_node": 2},
    {"provider": "local", "region": "local", "zone": "local-a", "instance_type": "local.cpu1",
     "gpus_per_node": 1},
]


def test_mixed_gpu_counts_keep_the_global_batch_through_a_preemption(run_demo) -> None:
    # paced while the world is short of 3: the survivor (in-process, at once) would
    # otherwise finish before the replacement boots and the world grows back
    s = run_demo(
        target_steps=150,
        **paced(3),
        offers=OFFERS,
        pool={"min_nodes": 1, "target_nodes": 2, "max_nodes": 2},
        chaos=[{"action": "notice", "node": 1, "at_step": 20, "lead_s": 20}],
    )
    assert s["steps_completed"] == s["target_steps"] == 150
    assert s["lost_steps_on_notice"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    ws = s["world_sizes"]
    # 2 + 1 ranks, then the 1-rank node alone, then a new 2-rank node joins it.
    assert ws[0] == 3 and 1 in ws and ws[-1] == 3, ws
    assert s["preemptions_with_notice"] == 1
