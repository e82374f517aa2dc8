"""The survivors' warning after a failed collective says where it was raised
(``trainer.recovery.raised_in``): a gloo timeout's message names no step part, and a
hang after a resize is diagnosed from that line alone (the run's only record)."""

from __future__ import annotations

from trainer.recovery import first_line, raised_in


def _all_reduce() -> None:
    raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 120000ms for send\nmore")


def _mean_loss() -> None:
    _all_reduce()


def _train_step() -> None:
    _mean_loss()


def test_the_failure_names_the_innermost_frames_first() -> None:
    try:
        _train_step()
    except RuntimeError as exc:
        where = raised_in(exc, frames=3)
        line = first_line(exc)
    assert line.endswith("Timed out waiting 120000ms for send")
    parts = where.split(" < ")
    assert [p.split(" ")[1] for p in parts] == ["_all_reduce", "_mean_loss", "_train_step"]
    assert all(p.startswith("test_recovery_where.py:") for p in parts)


def test_an_exception_never_raised_has_no_place() -> None:
    assert raised_in(RuntimeError("x")) == ""


def test_gloos_failure_reads_whole_and_short() -> None:
    """gloo's message leads with the C++ source path of the build machine and runs past
    200 characters: the line keeps the file's name and ends at a word, not mid-word."""
    exc = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                       "[127.0.0.1]:19681: Connection reset by peer. This is typically caused by a remote worker "
                       "hanging or bugs in the application code. " + "More detail follows here. " * 6)
    line = first_line(exc)
    assert line.startswith("[pair.cc:537] Read error [127.0.0.1]:19681: Connection reset by peer."), line
    assert len(line) <= 200 and line.endswith("…") and line[:-1].endswith(("follows", "here.", "More", "detail")), line
    assert first_line(RuntimeError("")) == "RuntimeError"
