"""The paced reference trainer (:mod:`e2e.paced_trainer`) that first checks what the job's
environment gave it: ``job.env`` values, ``job.secrets`` values (issue 26), by hash.

Every worker process, before it trains (the first ones and each replacement's), reads
``$E2E_EXPECT`` (a ``job.env`` entry): JSON ``{NAME: sha256 hex of the value it must
have}``, and writes one proof file into ``$E2E_PROOF_DIR`` (``job.env`` too):
``<node>-<rank>-<pid>.json`` with ``{"node", "rank", "got": {NAME: sha256 hex or null}}``;
hashes only, never a value. A worker missing any expected value, or holding another,
exits 3 before it trains (the job then never completes). Add entries to ``E2E_EXPECT`` to
check more of the environment (a workdir's version, a setup's marker).

Run by torchrun as ``-m e2e.env_trainer`` (the tests put ``tests/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path


def check_env() -> bool:
    """Write this worker's proof; True when every expected value is there and right."""
    expect: dict[str, str] = json.loads(os.environ.get("E2E_EXPECT", "{}"))
    got = {name: (hashlib.sha256(os.environ[name].encode()).hexdigest() if name in os.environ else None)
           for name in expect}
    node, rank = os.environ.get("SPOTVISOR_NODE_ID", "?"), os.environ.get("RANK", "?")
    proof = Path(os.environ["E2E_PROOF_DIR"]) / f"{node}-{rank}-{os.getpid()}.json"
    tmp = proof.with_suffix(".tmp")
    tmp.write_text(json.dumps({"node": node, "rank": rank, "got": got}))
    tmp.replace(proof)
    return got == expect


def main() -> int:
    if not check_env():
        print("e2e.env_trainer: the job's environment is not what the test expected (see the proof file)",
              file=sys.stderr)
        return 3
    from e2e.paced_trainer import main as paced_main

    return paced_main()


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())
