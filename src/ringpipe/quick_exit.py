"""A quicker interpreter exit for processes that import torch: ``RINGPIPE_QUICK_EXIT=1`` (off by default).

Why: Python's shutdown runs the cyclic garbage collector over every object still alive, more than
once (before and while the modules are torn down). A process that imported torch and used an
optimizer (which imports ``torch._dynamo``) holds millions of them, so its exit costs 0.5-1.5 s
of CPU after its last line, measured on the 2-core test machine; a test suite that starts
hundreds of such processes pays minutes for it.

With ``RINGPIPE_QUICK_EXIT=1`` in its environment, a process that imports ringpipe collects its
garbage once at exit (after the other exit handlers, so that every object that is garbage by then
is finalized as usual) and then freezes what is still alive (``gc.freeze()``), so that the
shutdown's own collections skip it. Only objects that are still alive when the interpreter exits
are affected: Python does not promise to finalize those (the language reference, ``__del__``),
and what releases them by reference counting (a module's open file, say) is still released. The
exit handlers, the flushing of the standard streams and the exit status are unchanged.

The test suite sets it for every process it starts (``tests/conftest.py``).
"""

from __future__ import annotations

import atexit
import gc
import os

__all__ = ["QUICK_EXIT", "install", "requested"]

#: The environment variable that asks for the quicker exit ("1", "true", "yes" or "on").
QUICK_EXIT = "RINGPIPE_QUICK_EXIT"

_INSTALLED = [False]


def requested(env: dict[str, str] | None = None) -> bool:
    """Whether ``RINGPIPE_QUICK_EXIT`` asks for the quicker exit."""
    value = (os.environ if env is None else env).get(QUICK_EXIT, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()


def install() -> bool:
    """Register the exit handler once, when requested; whether it is registered.

    Exit handlers run last registered first: this one, registered when ringpipe is first
    imported, runs after those of the modules and programs imported later.
    """
    if not _INSTALLED[0] and requested():
        atexit.register(_collect_then_freeze)
        _INSTALLED[0] = True
    return _INSTALLED[0]
