"""The past a pool starts from: the market directory the pools of a control node share
(daemon/controlnode/market_memory.py, issue 31).

Two pools whose configs name their domains differently but buy the same things read each
other's record; what another uid, a planted link, a huge or malformed file put in the
directory is skipped, never raised, never followed; a record its daemon stopped
rewriting is its word only up to its last write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import structlog

from daemon.config import Config
from daemon.control.availability import Availability
from daemon.controlnode import market_memory as mm
from daemon.controlnode.market_memory import STALE_S, MarketMemory, market_key

H = 3600.0


def _config(pool: str, names: tuple[str, str], market_dir: Path | None, *, west_type: str = "p3.2xlarge") -> Config:
    east, west = names
    return Config.model_validate({
        "pool": {"name": pool, "min_nodes": 1, "target_nodes": 1, "max_nodes": 1, "on_demand_fallback": True},
        "job": {"id": "j", "module": "m", "target_steps": 10},
        "daemon": {"market_dir": None if market_dir is None else str(market_dir)},
        "providers": {"local": None, "aws": {"image_id": "ami-0123456789abcdef0"}},
        "domains": [
            {"name": east, "provider": "aws", "region": "us-east-1",
             "checkpoint_uri": "s3://b/east", "rendezvous": {"host": "10.0.0.1", "port": 29400}},
            {"name": west, "provider": "aws", "region": "us-west-2",
             "checkpoint_uri": "s3://b/west", "rendezvous": {"host": "10.1.0.1", "port": 29400},
             "launch": {"image_id": "ami-0fedcba9876543210"}},
        ],
        "offers": [
            {"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "p3.2xlarge",
             "domain": east},
            {"provider": "aws", "region": "us-west-2", "zone": "us-west-2b", "instance_type": west_type,
             "domain": west},
            {"provider": "aws", "region": "us-west-2", "zone": "us-west-2b", "instance_type": west_type,
             "domain": west, "market": "on_demand"},
        ],
    })


def test_a_market_is_what_a_domain_buys_whatever_the_pool_calls_it(tmp_path: Path) -> None:
    a = _config("a", ("east", "west"), tmp_path)
    b = _config("b", ("use1", "usw2"), tmp_path)
    other_type = _config("c", ("use1", "usw2"), tmp_path, west_type="p3.8xlarge")
    assert market_key(a, a.domain("west")) == market_key(b, b.domain("usw2")) == "aws/us-west-2/-/us-west-2b:p3.2xlarge"
    assert market_key(other_type, other_type.domain("usw2")) != market_key(a, a.domain("west"))
    assert MarketMemory.for_config(_config("d", ("e", "w"), None)) is None


def test_a_pool_reads_another_pools_record_by_its_own_domain_names(tmp_path: Path) -> None:
    """Pool a writes what it saw (only its own record: never what it took from others);
    pool b reads it as its own domains; a's own file is not among what a reads."""
    a = MarketMemory.for_config(_config("a", ("east", "west"), tmp_path / "market"))
    b = MarketMemory.for_config(_config("b", ("use1", "usw2"), tmp_path / "market"))
    assert a is not None and b is not None
    record = Availability().observe("west", True, 1 * H).observe("west", False, 5 * H).observe("east", True, 2 * H)
    a.write(record, 6 * H)
    assert (tmp_path / "market" / "a.json").stat().st_mode & 0o777 == 0o600
    assert b.read_others(6 * H) == [{"usw2": [(1 * H, True), (5 * H, False)], "use1": [(2 * H, True)]}]
    assert a.read_others(6 * H) == []


def test_a_record_not_rewritten_for_a_while_is_its_pools_word_only_up_to_its_last_write(tmp_path: Path) -> None:
    a = MarketMemory.for_config(_config("a", ("east", "west"), tmp_path))
    b = MarketMemory.for_config(_config("b", ("east", "west"), tmp_path))
    assert a is not None and b is not None
    a.write(Availability().observe("west", True, 1 * H), 2 * H)
    assert b.read_others(2 * H + STALE_S - 1) == [{"west": [(1 * H, True)]}]  # fresh: up until now
    assert b.read_others(2 * H + STALE_S + 1) == [{"west": [(1 * H, True), (2 * H, None)]}]  # unwatched since


def _plant(directory: Path, name: str, kind: str, victim: Path) -> None:
    path = directory / name
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "huge":
        path.write_bytes(b" " * (mm.MAX_FILE_BYTES + 1))
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text(kind)


@pytest.mark.parametrize("kind", [
    "symlink", "huge", "fifo", "not json", json.dumps([1, 2]), json.dumps({"version": 2, "markets": {}}),
    json.dumps({"version": 1, "written_at": "soon", "markets": {}}),
    json.dumps({"version": 1, "written_at": 0, "markets": {"aws/us-west-2/-/us-west-2b:p3.2xlarge": [[0, "up"]]}}),
    json.dumps({"version": 1, "written_at": 0, "markets": {"aws/us-west-2/-/us-west-2b:p3.2xlarge": [[True, True]]}}),
    '{"version": 1, "written_at": 0, "markets": {"aws/us-west-2/-/us-west-2b:p3.2xlarge": [[NaN, true]]}}',
    json.dumps({"version": 1, "written_at": 0,
                "markets": {"aws/us-west-2/-/us-west-2b:p3.2xlarge": [[0, True]] * (mm.MAX_CHANGES + 1)}}),
], ids=["symlink", "huge", "fifo", "not-json", "a-list", "version-2", "bad-time", "bad-state", "bool-time", "nan",
        "too-many-changes"])
def test_a_bad_file_in_the_directory_is_skipped_with_one_warning_and_the_rest_is_read(tmp_path: Path,
                                                                                       kind: str) -> None:
    directory = tmp_path / "market"
    a = MarketMemory.for_config(_config("a", ("east", "west"), directory))
    b = MarketMemory.for_config(_config("b", ("east", "west"), directory))
    assert a is not None and b is not None
    a.write(Availability().observe("west", True, 1 * H), 2 * H)
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps({"version": 1, "written_at": 0, "markets": {}}))
    _plant(directory, "bad.json", kind, victim)
    with structlog.testing.capture_logs() as logs:
        assert b.read_others(2 * H) == [{"west": [(1 * H, True)]}]
        assert b.read_others(2 * H) == [{"west": [(1 * H, True)]}]
    warned = [e for e in logs if e["event"] == "market_record_skipped"]
    assert len(warned) == 1 and warned[0]["file"] == "bad.json", logs


def test_a_directory_that_cannot_be_written_raises_for_the_caller_to_log(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    memory = MarketMemory.for_config(_config("a", ("east", "west"), tmp_path / "file" / "market"))
    assert memory is not None
    with pytest.raises(OSError):
        memory.write(Availability().observe("west", True, 1.0), 2.0)
    assert memory.read_others(2.0) == []  # and reading it is nothing, not an error


def test_the_record_file_is_what_the_docstring_says(tmp_path: Path) -> None:
    a = MarketMemory.for_config(_config("a", ("east", "west"), tmp_path))
    assert a is not None
    a.write(Availability().observe("west", True, 1.0).observe("west", None, 2.0), 3.0)
    doc: dict[str, Any] = json.loads((tmp_path / "a.json").read_text())
    assert doc == {"version": 1, "pool": "a", "written_at": 3.0,
                   "markets": {"aws/us-west-2/-/us-west-2b:p3.2xlarge": [[1.0, True], [2.0, None]]}}


def test_a_file_renamed_away_between_the_listing_and_its_read_is_not_an_error(tmp_path: Path) -> None:
    a = MarketMemory.for_config(_config("a", ("east", "west"), tmp_path))
    b = MarketMemory.for_config(_config("b", ("east", "west"), tmp_path))
    assert a is not None and b is not None
    a.write(Availability().observe("west", True, 1.0), 2.0)
    [entry] = list(os.scandir(tmp_path))
    (tmp_path / "a.json").unlink()  # as a pool's rename over it, between scandir and stat
    assert mm._mtime(entry) == float("-inf")
    assert b.read_others(2.0) == []
