"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM: within a few seconds, with the newest complete
checkpoint intact and the run's lock released.

Python raises KeyboardInterrupt wherever the main thread happens to be when the signal lands; if
that is a finalizer (a `__del__`, a weakref callback), Python prints "Exception ignored" and
carries on, so the run trains on as if nothing happened. Here a stop is also remembered: the
training loop asks for it after every step (`check`), so a swallowed one stops the run one step
later. A checkpoint being written is finished first (`deferred`); a second signal stops at once.
The seconds before any of that, while glassformer imports torch, are `interrupt_exits`'.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


class Stopped(KeyboardInterrupt):
    """A run stopped by a signal; the CLI exits with 128 + signum (130 for Ctrl-C)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class StopRequests:
    """`with StopRequests() as stop:` turns SIGINT and SIGTERM into Stopped for its block, in
    the main thread (elsewhere it does nothing: only the main thread can own signals). Blocks
    nest (the CLI's around the whole command, the trainer's around its loop) and share what
    was requested: a stop swallowed while the model was built is still found by the loop."""

    _requested: int | None = None  # the signal of the outermost block's run, shared by all
    _depth = 0

    def __init__(self) -> None:
        self._deferring = 0
        self._previous: dict[int, object] = {}
        self._entered = False

    @property
    def signum(self) -> int | None:
        return StopRequests._requested

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is not threading.main_thread():
            return self
        if StopRequests._depth == 0:
            StopRequests._requested = None
        StopRequests._depth += 1
        self._entered = True
        for signum in SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup and `&` ignore SIGINT
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._entered:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._entered = False
        StopRequests._depth -= 1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        again = StopRequests._requested is not None
        StopRequests._requested = signum
        if again or not self._deferring:
            raise Stopped(signum)

    def check(self) -> None:
        """Raise Stopped if a signal came and its exception was swallowed on the way."""
        if StopRequests._requested is not None:
            raise Stopped(StopRequests._requested)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block a first signal does not cut short (a checkpoint being saved): the stop is
        raised as the block ends."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring:
            self.check()
