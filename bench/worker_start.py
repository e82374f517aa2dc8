"""``python -m bench.worker_start``: what a torchrun worker's start costs, fresh or forked from the zygote.

Each sample starts one worker the way torchrun does (``$PYTHON_EXEC -u -m <module>``), with
``$PYTHON_EXEC`` the real interpreter (fresh) or the zygote's client
(:mod:`daemon.gpunode.zygote_client`, forked from a zygote that preloaded ``trainer.run``).
The worker (:data:`PROBE`) does what a reference trainer's rank does before its first
step on this model: import ``trainer.run``, build the GPT-2 of ``configs/local.yaml``
(4 layers x 256) and run one forward pass, then reports its own CPU seconds
(``os.times``: a forked worker's count from its fork) and the wall time since the client
was started. The first forked worker is asked for as soon as the zygote listens, so it
waits for the zygote's imports (a node admitted right after it registered). Prints a
table and writes JSON (``--out``). Nothing asserts a number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = """\
import json, os, sys, time
import torch
from trainer.run import build_model, build_parser
args = build_parser().parse_args(["--seq-len", "128", "--n-layer", "4", "--n-embd", "256", "--n-head", "4",
                                  "--target-steps", "1", "--global-batch-size", "1", "--micro-batch-size", "1",
                                  "--checkpoint-uri", "file:///tmp/unused"])
device = torch.device(os.environ.get("PROBE_DEVICE", "cpu"))
model = build_model(args).to(device)
model(torch.zeros(1, 8, dtype=torch.long, device=device))
if device.type == "cuda":
    torch.cuda.synchronize()  # CUDA initialised and used in this worker: after a fork, from a parent that never did
t = os.times()
print(json.dumps({"cpu_s": t.user + t.system, "wall_s": time.time() - float(os.environ["STARTED"]),
                  "forked": os.environ.get("FORKED_CHECK") == "1" and "transformers" in sys.modules}))
"""

HOST = """\
import json, sys
from daemon.gpunode.zygote import Worker, fork_server
forked = fork_server(None)
if isinstance(forked, Worker):
    forked.run()
    sys.exit(0)
print(json.dumps(forked and forked.worker_env()), flush=True)
sys.stdin.read()
"""


def _sample(python_exec: str, env: dict[str, str], cwd: str) -> dict:
    started = time.time()
    done = subprocess.run([python_exec, "-u", "-m", "bench_worker_probe"], env={**env, "STARTED": repr(started)},
                          cwd=cwd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5, help="workers started each way (default 5)")
    ap.add_argument("--out", default="bench-results-worker-start.json")
    ap.add_argument("--device", default="cpu", help="where the probe's forward pass runs: cpu, or cuda on a GPU "
                                                    "machine (the zygote's check that CUDA works in a forked worker)")
    args = ap.parse_args(argv)
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "bench_worker_probe.py").write_text(PROBE)
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": os.pathsep.join([tmp, root]),
                "OMP_NUM_THREADS": "1", "SPOTVISOR_ZYGOTE_PRELOAD": "trainer.run", "PROBE_DEVICE": args.device}
        host = subprocess.Popen([sys.executable, "-c", HOST], env=base, cwd=tmp, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            zygote_env = json.loads(host.stdout.readline())  # type: ignore[union-attr]
            if zygote_env is None:
                print("the zygote did not start", file=sys.stderr)
                return 1
            forked_env = {**base, **zygote_env, "FORKED_CHECK": "1"}
            # asked for at once: it waits for the zygote's imports, as a node admitted right
            # after it registered would
            first = _sample(zygote_env["PYTHON_EXEC"], forked_env, tmp)
            rows = {"fresh": [_sample(sys.executable, base, tmp) for _ in range(args.n)],
                    "forked": [_sample(zygote_env["PYTHON_EXEC"], forked_env, tmp) for _ in range(args.n)]}
        finally:
            host.stdin.close()  # type: ignore[union-attr]
            host.wait(timeout=60)
    assert first["forked"] and all(r["forked"] for r in rows["forked"]), "a worker was not forked"
    print(f"worker start to its first forward pass on {args.device}, {args.n} workers each way "
          f"({os.cpu_count()} CPUs); the first forked one, asked for as the zygote started, "
          f"waited {first['wall_s']:.2f} s for its imports")
    print(f"{'start':<8} {'CPU-s median':>13} {'CPU-s max':>10} {'wall s median':>14} {'wall s max':>11}")
    result = {"n": args.n, "device": args.device, "first_forked_wall_s": first["wall_s"], "nproc": os.cpu_count()}
    for name, samples in rows.items():
        cpu = [s["cpu_s"] for s in samples]
        wall = [s["wall_s"] for s in samples]
        print(f"{name:<8} {statistics.median(cpu):>13.2f} {max(cpu):>10.2f} {statistics.median(wall):>14.2f} "
              f"{max(wall):>11.2f}")
        result[name] = {"cpu_s": cpu, "wall_s": wall}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
