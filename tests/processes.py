"""Helpers for tests that start glassformer in a child process and signal it."""

from __future__ import annotations

import signal

# How long a test waits for a child process to start, save, stop or finish before it fails.
# Python and torch start in about 5 s on an idle 2-core machine and several times that on a
# loaded one (a 60 s wait once ran out there). A deadline only bounds a failure, so it is
# generous; what a test claims about speed (a run stops within seconds of Ctrl-C) it asserts
# on its own, with its own bound.
DEADLINE_S = 240.0


def default_sigint() -> None:
    """A Popen preexec_fn: let the child take Ctrl-C even when pytest runs as a background job
    (`make test &`), in which the shell hands every child SIGINT ignored and Python leaves it
    so (the trainer, like Python, keeps an ignored signal ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
