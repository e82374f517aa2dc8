"""bench/replay/traces.py: every public trace format, recognised from its content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay.traces import TraceError, load_trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_add_remove_events_become_the_groups_alive_count(tmp_path: Path) -> None:
    t = load_trace(_write(tmp_path, "p3.csv", "0,add,node1\n0,add,node2\n60000,remove,node1\n90000,add,node3\n"))
    z = t.zones["p3"]
    assert t.format == "events" and t.max_nodes == 2
    assert z.times == (0.0, 60.0, 90.0) and z.capacity == (2, 1, 2)
    assert z.capacity_at(59.9) == 2 and z.capacity_at(60) == 1 and z.capacity_at(1e9) == 2


def test_a_trace_that_starts_late_holds_nothing_before_its_first_event(tmp_path: Path) -> None:
    z = load_trace(_write(tmp_path, "g.csv", "480000,add,node1\n")).zones["g"]
    assert z.times == (0.0, 480.0) and z.capacity == (0, 1)


def test_alive_counts(tmp_path: Path) -> None:
    t = load_trace(_write(tmp_path, "alive.csv", "0,3\n1000,2\n5000,4\n"))
    assert t.format == "alive" and t.zones["alive"].capacity == (3, 2, 4) and t.max_nodes == 4


def test_parcae_windows_ignore_parcaes_own_moves(tmp_path: Path) -> None:
    lines = [[0, "add", {"nodes": ["a", "b", "c"], "duration": 60000}],
             [60000, "remove", {"nodes": ["b"], "duration": 60000}],
             [120000, "migration", {"nodes": [], "duration": 60000}],
             [180000, "no-op", {"nodes": [], "duration": 60000}]]
    t = load_trace(_write(tmp_path, "w.txt", "\n".join(json.dumps(x) for x in lines)))
    z = t.zones["w"]
    assert t.format == "parcae-window" and t.duration_s == 240.0
    assert z.capacity_at(30) == 3 and z.capacity_at(150) == 2 and z.capacity_at(200) == 2


def test_gcloud_counts_and_concatenated_runs(tmp_path: Path) -> None:
    text = ("2021-12-10, 13:07:45, 80\n2021-12-10, 13:08:45, 79\n"
            "2021-12-10, 09:00:00, 50\n2021-12-10, 09:01:00, 51\n")  # a second run, earlier in the day
    t = load_trace(_write(tmp_path, "v100.txt", text))
    z = t.zones["v100"]
    assert t.format == "gcloud" and z.times == (0.0, 60.0, 120.0, 180.0) and z.capacity == (80, 79, 50, 51)
    assert t.notes == ("2 concatenated runs laid end to end",)


def test_a_folder_of_zones_with_prices(tmp_path: Path) -> None:
    d = tmp_path / "v100"
    d.mkdir()
    (d / "us-east-1a_v100_1.csv").write_text("date,availability\n2023-02-15 22:08:16,0\n2023-02-15 22:11:31,1\n")
    (d / "us-west-2a_v100_1.csv").write_text("date,availability\n2023-02-15 22:08:16,1\n2023-02-15 22:11:31,1\n")
    (d / "spot_prices.json").write_text(json.dumps({"us-east-1a_v100_1": [1.67, 1.5], "us-west-2a_v100_1": [0.9, 0.9]}))
    t = load_trace(d)
    assert t.format == "zones" and sorted(t.zones) == ["us-east-1a", "us-west-2a"]
    east = t.zones["us-east-1a"]
    assert east.capacity == (0, None) and east.times == (0.0, 195.0) and east.price_at(200) == 1.5
    assert t.duration_s == 390.0  # the last row lasts one row's spacing


def test_a_window_is_rebased_to_start_at_zero(tmp_path: Path) -> None:
    t = load_trace(_write(tmp_path, "p3.csv", "0,add,n1\n0,add,n2\n60000,remove,n1\n120000,remove,n2\n"))
    w = t.window(30, 90)
    z = w.zones["p3"]
    assert w.duration_s == 60 and z.times == (0.0, 30.0) and z.capacity == (2, 1)


@pytest.mark.parametrize("text, problem", [
    ("0,add,n1\n0,remove,n2\n", "n2 is removed but was never added"),
    ("0,add,n1\n-5,add,n2\n", "negative"),
    ("100,add,n1\n50,add,n2\n", "goes backwards"),
    ("0,join,n1\n", "not a trace this reads"),
    ("hello\n", "not a trace this reads"),
    ("", "empty"),
])
def test_a_bad_trace_is_one_line_naming_the_file_and_line(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(TraceError) as info:
        load_trace(_write(tmp_path, "bad.csv", text))
    assert problem in str(info.value) and "bad.csv" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(not SHARED.exists(), reason="the shared traces are not beside this checkout")
def test_the_shared_traces_read_as_their_readme_says() -> None:
    p3 = load_trace(SHARED / "bamboo" / "p3-trace.csv")
    assert p3.max_nodes == 32 and round(p3.duration_s / 3600, 1) == 11.4
    alive = load_trace(SHARED / "parcae" / "p3-alive.csv")
    assert alive.zones["p3-alive"].capacity == p3.zones["p3-trace"].capacity  # the same trace, two formats
    hh = load_trace(SHARED / "parcae" / "gpt-6.7b" / "trace_hh_55_65.txt").zones["trace_hh_55_65"]
    assert (min(hh.capacity), max(hh.capacity)) == (20, 32)
    sky = load_trace(SHARED / "skynomad" / "v100-9zone")
    assert len(sky.zones) == 9 and all(len(z.times) == 20158 for z in sky.zones.values())
    assert all(0.9 <= min(z.price) and max(z.price) <= 1.9 for z in sky.zones.values())
