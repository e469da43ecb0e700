"""Stopping a background build at its safe points.

A a background build (``compile.startup``) build runs on a thread of its own (``BackgroundBuild``); a start-up
that fails after it began (a KV cache that does not fit, a checkpoint that lacks a weight) cancels
it, so that its thread, the model it holds and the one-build-at-a-time lock are let go within
seconds rather than when the build would have ended. Python cannot stop a thread from outside, so
the build checks at points where nothing is half done: between its phases, before each FX trace of
a pass's pattern and before each Inductor compile of a piece. There it raises ``BuildCancelled``,
a ``BaseException`` so that no ``except Exception`` on the way swallows it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_this_thread = threading.local()


class BuildCancelled(BaseException):
    """A background build stopped at a safe point, its start-up having failed."""


@contextlib.contextmanager
def cancellable(cancel: threading.Event) -> Iterator[None]:
    """This thread's ``check_cancelled`` calls raise once ``cancel`` is set."""
    _this_thread.cancel = cancel
    try:
        yield
    finally:
        _this_thread.cancel = None


def check_cancelled() -> None:
    """A safe point: raise ``BuildCancelled`` if this thread's build was cancelled (elsewhere, and
    on other threads, nothing)."""
    cancel = getattr(_this_thread, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise BuildCancelled("the start-up this build belonged to failed")
