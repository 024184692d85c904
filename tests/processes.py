"""Helpers for tests that start glassformer in a child process and signal it."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """A Popen preexec_fn: let the child take Ctrl-C even when pytest runs as a background job
    (`make test &`), in which the shell hands every child SIGINT ignored and Python leaves it
    so (the trainer, like Python, keeps an ignored signal ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
