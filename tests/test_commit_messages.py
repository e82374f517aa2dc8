"""CONTRIBUTING.md's commit message rule, as `.ci/check-commits` applies it."""

import importlib.machinery
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check_commits():
    loader = importlib.machinery.SourceFileLoader("check_commits", str(ROOT / ".ci" / "check-commits"))
    spec = importlib.util.spec_from_loader("check_commits", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_a_short_subject_with_a_body_passes() -> None:
    assert _check_commits().problems("fleet: settle a lost launch\n\nBecause the daemon died.\n", 1) == []


def test_a_long_subject_and_a_missing_body_are_each_named() -> None:
    out = _check_commits().problems("x" * 73 + "\n", 1)
    assert out == ["subject is 73 characters (at most 72)", "no body: say why in a few lines after a blank line"]


def test_a_body_must_follow_a_blank_line() -> None:
    assert "the second line must be blank" in _check_commits().problems("fleet: a\nwhy\n", 1)


def test_a_merge_needs_only_the_subject_rule() -> None:
    assert _check_commits().problems("Merge branch 'i28-core'\n", 2) == []
