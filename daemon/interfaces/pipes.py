"""A command whose output is piped into one that stops reading (``spotctl events | head``)."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

__all__ = ["quiet_broken_pipe"]


def quiet_broken_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command's ``main``: when the reader of its standard output goes away, it
    exits 1 quietly instead of with a ``BrokenPipeError`` traceback (the recipe of the
    Python docs, "Note on SIGPIPE", https://docs.python.org/3/library/signal.html): the
    standard output is pointed at ``/dev/null`` so the interpreter's final flush does not
    fail again."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 1

    return wrapped
