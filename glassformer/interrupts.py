"""Ctrl-C while glassformer loads: the seconds before any command or run of its own has started
(torch's import alone takes a second or two), and before train/signals.py's handlers exist.
A leaf module (the standard library only), so that the package and the CLI import it first."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def interrupt_exits() -> Iterator[None]:
    """A block in which Ctrl-C (SIGINT) ends the process at once with 130, as the CLI does for
    a command: glassformer's imports (torch's alone take a second or two). Python's own
    handler raises KeyboardInterrupt wherever the import is, and inside a class body's
    `__set_name__` Python 3.11 wraps it in a RuntimeError: a traceback and exit status 1 for a
    Ctrl-C. Nothing has been written yet, so there is nothing to finish. Only in a program's
    main thread, over Python's default handler: an ignored SIGINT (nohup, `&`), one a program
    handles itself (Jupyter) and an interactive session (where Ctrl-C cancels the import and
    the prompt stays) are left as they are."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        or hasattr(sys, "ps1")
        or sys.flags.interactive
    ):
        yield
        return
    signal.signal(signal.SIGINT, _exit_at_once)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _exit_at_once:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write(f"\ninterrupted ({signal.Signals(signum).name})\n")
    sys.stderr.flush()
    os._exit(128 + signum)
