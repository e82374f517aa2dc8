"""How a worker started through ``trainer.integrations.hf_launch`` ends once the user's
script is done (:func:`trainer.integrations.common.end_worker`).

The script here has the shape of the HF Trainer's end: its last collective all-gathers
tensors it made and drops at once (``Trainer.store_flos``). Ended by the interpreter's
finalization, rank 1 aborted in about 1 run of 3 on the loaded 2-core machine
("terminate called without an active exception", exit -6: a gloo worker thread
releasing that work took the GIL after finalization began), and torchrun reported the
finished job as failed. Each run below is one such chance; every one must exit 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")

SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, sys, threading
    from pathlib import Path

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    out = Path(os.environ["OUT"])

    def at_exit():  # the script's own handler: must still run, after the group is left
        (out / f"atexit-{rank}.json").write_text(json.dumps({"initialized": dist.is_initialized()}))

    def main():
        dist.init_process_group("gloo")  # as the Trainer (accelerate) does when hf_launch restores nothing
        atexit.register(at_exit)
        for _ in range(20):
            t = torch.tensor([float(rank)])
            parts = [t.clone() for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t)  # Trainer.store_flos: its last collective
            assert torch.cat(parts).sum().item() == 1.0
        # a non-daemon thread still working when the script returns: the interpreter would wait for it
        threading.Thread(target=lambda: (out / f"thread-{rank}").write_text("done")).start()
        print(f"rank {rank} unflushed", end="")  # no newline: only a flush at the end shows it

    main()
    if os.environ["END"] != "return":
        sys.exit(int(os.environ["END"]))
    """
)


def _launch(tmp: Path, end: str) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True)
    script = tmp / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OUT": str(tmp), "END": end}
    return subprocess.run([str(TORCHRUN), "--nproc-per-node=2", "--standalone", "-m", "trainer.integrations.hf_launch",
                           "--", str(script)], cwd=tmp, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_finished_script_leaves_the_group_on_every_rank_and_exits_0(tmp_path: Path) -> None:
    # the old ending fails the atexit check on every run: one run per way of ending is enough
    for i, end in enumerate(["return", "0"]):
        run = _launch(tmp_path / str(i), end)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "terminate called" not in run.stderr
        for rank in (0, 1):
            # the script's atexit handler ran, once the group was left on this rank
            assert json.loads((tmp_path / str(i) / f"atexit-{rank}.json").read_text()) == {"initialized": False}
            assert (tmp_path / str(i) / f"thread-{rank}").read_text() == "done"  # its thread was waited for
            assert f"rank {rank} unflushed" in run.stdout


@pytest.mark.slow
def test_a_script_that_exits_non_zero_keeps_its_exit_code(tmp_path: Path) -> None:
    run = _launch(tmp_path / "run", "3")
    assert run.returncode != 0
    assert "exitcode  : 3" in run.stderr  # torchrun's summary: the script's own code, not a crash


def test_the_scripts_exit_is_read_as_python_reads_it() -> None:
    from trainer.integrations.hf_launch import _exit_code

    assert [_exit_code(c) for c in (None, 0, 3, True, 256, -1)] == [0, 0, 3, 1, 0, 255]
    assert _exit_code("out of memory") == 1  # printed to stderr, as Python prints it
