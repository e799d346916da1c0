"""What a communication call hands back and is described by: its handle in flight, reduce ops, its error type.

:class:`Work` is the handle of an operation in flight (``wait()``, ``is_completed()``), which
closes the operation's event in the log when it completes and names a peer that left when the
backend reports a lost connection; :class:`ReduceOp` the reductions every backend offers;
:class:`CommError` a call with arguments the backend cannot serve. :mod:`ringpipe.comm.base`
re-exports them with the :class:`~ringpipe.comm.base.Communicator` that returns them.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

import torch

from ringpipe.comm.events import COMM, NBYTES, OP, EventLog, add_blocked

__all__ = ["CommError", "ReduceOp", "Work", "nbytes_of", "raise_departure"]


class CommError(RuntimeError):
    """A communication call was made with arguments the backend cannot serve."""


class ReduceOp(enum.Enum):
    """Reduction operators (Horovod's names are aliases at the top level)."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"  # adaptive summation: ringpipe.collectives.adasum_allreduce

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            valid = ", ".join(o.value for o in cls)
            raise ValueError(f"unknown reduce op {op!r}; valid ops: {valid}") from None


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Work:
    """Handle of an operation in flight: ``wait()`` blocks until it completes and returns its result."""

    __slots__ = ("_wait", "_test", "_event", "_result", "_done", "_post")

    def __init__(
        self,
        wait: Callable[[], Any] | None,
        test: Callable[[], bool] | None,
        event: list[Any] | None = None,
        result: Any = None,
        post: Callable[[], Any] | None = None,
    ) -> None:
        self._wait = wait
        self._test = test
        self._event = event
        self._result = result
        self._post = post
        self._done = wait is None

        if self._done:
            self._finish()

    def _finish(self) -> None:
        if self._post is not None:
            post, self._post = self._post, None
            out = post()
            if out is not None:
                self._result = out
        if self._event is not None:
            EventLog.end(self._event)
        self._done = True

    def wait(self) -> Any:
        if not self._done:
            assert self._wait is not None
            t0 = time.perf_counter_ns()
            try:
                self._wait()
            except RuntimeError as exc:
                if self._event is not None:
                    raise_departure(exc, self._event)
                raise
            add_blocked(time.perf_counter_ns() - t0)
            self._finish()
        return self._result

    def is_completed(self) -> bool:
        if not self._done and self._test is not None and self._test():
            self._finish()
        return self._done

    @classmethod
    def done(cls, result: Any = None) -> Work:
        return cls(None, None, None, result)


def raise_departure(exc: RuntimeError, ev: list[Any]) -> None:
    """Raise a backend's lost-peer error as a PeerDeparted naming the rank that left (if it is one)."""
    from ringpipe.comm.departures import translate

    named = translate(exc, ev[OP], ev[NBYTES], ev[COMM])  # an inner call's PeerDeparted: named after this one
    if named is not None:
        raise named from exc
