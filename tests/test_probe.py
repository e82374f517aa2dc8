"""`spotvisor-agent probe`: one poll against each dialect's endpoint, as an operator runs it."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import pytest

from daemon.gpunode.metadata.registry import DIALECTS
from daemon.providers.local_metadata import make_fake


async def probe(dialect: str, url: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.gpunode.agent", "probe", "--dialect", dialect, "--metadata-url", url,
        "--timeout-s", "2", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_probe_prints_null_then_the_notice(dialect: str) -> None:
    async with make_fake(dialect) as fake:
        rc, out, err = await probe(dialect, fake.url)
        assert (rc, out.strip()) == (0, "null"), err
        fake.publish_interruption()
        rc, out, err = await probe(dialect, fake.url)
        assert rc == 0, err
        line = json.loads(out)
        assert set(line) == {"provider", "kind", "action", "deadline", "id"}
        assert line["provider"] == dialect and line["kind"] == "interruption"
        assert line["deadline"].endswith("Z") and line["id"]


async def test_probe_unreachable_is_one_line_and_exit_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}"
    rc, out, err = await probe("aws", url)
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "Traceback" not in err
