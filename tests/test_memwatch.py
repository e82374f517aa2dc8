"""``trainer.memwatch.PeakRss``: the peak host memory a resize takes, its stretches only."""

from __future__ import annotations

import mmap
import sys

import pytest

from trainer.memwatch import PeakRss

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")

MB = 1 << 20
PAGE = mmap.PAGESIZE


def _touched(nbytes: int) -> mmap.mmap:
    """``nbytes`` of fresh anonymous memory, every page written: resident now, and gone from
    the resident set when closed. Not malloc's: glibc serves a request of any size from
    free heap memory an earlier test in this process left resident (its top chunk keeps up
    to 64 MB untrimmed, and a free hole inside the heap any size), and then the resident set
    does not grow at all (seen: the 48 MB transient below read as 0 in 43 of 200 rounds
    after assorted allocations; 0 of 200 with a fixed mmap threshold)."""
    m = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, PAGE):
        m[offset] = 1
    return m


def test_the_peak_of_a_tracked_stretch_counts_and_an_untracked_one_does_not() -> None:
    peak = PeakRss()
    with peak.track():
        held = _touched(64 * MB)  # kept past the stretch
    _touched(256 * MB).close()  # between the stretches: a commit's buffers, say
    with peak.track():
        _touched(48 * MB).close()  # a transient: only the mark remembers it
    got = peak.take()
    assert got is not None
    assert 64 * MB + 48 * MB - 8 * MB <= got < 256 * MB, got / MB
    held.close()
    assert peak.take() is None  # taken: it starts over
