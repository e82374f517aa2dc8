"""``trainer.memwatch.PeakRss``: the peak host memory a resize takes, its stretches only."""

from __future__ import annotations

import sys

import pytest
import torch

from trainer.memwatch import PeakRss

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")

MB = 1 << 20


def test_the_peak_of_a_tracked_stretch_counts_and_an_untracked_one_does_not() -> None:
    peak = PeakRss()
    with peak.track():
        held = torch.ones(64 * MB // 4)  # 64 MB, touched, kept past the stretch
    spike = torch.ones(256 * MB // 4)  # between the stretches: a commit's buffers, say
    del spike
    with peak.track():
        # above glibc's largest mmap threshold (32 MB on 64-bit, mallopt(3)): fresh pages,
        # never the freed but resident heap an earlier test in this process may have left
        transient = torch.ones(48 * MB // 4)
        del transient
    got = peak.take()
    assert got is not None
    assert 64 * MB + 48 * MB - 8 * MB <= got < 256 * MB, got / MB
    del held
    assert peak.take() is None  # taken: it starts over
