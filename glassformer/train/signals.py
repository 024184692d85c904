"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM: within a few seconds, with the newest complete
checkpoint intact and the run's lock released.

Python raises KeyboardInterrupt wherever the main thread happens to be when the signal lands; if
that is a finalizer (a `__del__`, a weakref callback), Python prints "Exception ignored" and
carries on, so the run trains on as if nothing happened. Here a stop is also remembered: the
training loop asks for it after every step (`check`), so a swallowed one stops the run one step
later. A checkpoint being written is finished first (`deferred`); a second signal stops at once.
The seconds before any of that, while glassformer imports torch, are glassformer/interrupts.py's.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
