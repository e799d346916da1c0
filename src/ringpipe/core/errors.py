"""The errors every face raises: a failed collective, a call before ``init``, a joined rank, updated hosts.

They live below the faces so that a program catches the same class whichever face it uses
(``hvd.HorovodInternalError`` from ``ringpipe``, ``ringpipe.tensorflow`` or ``ringpipe.keras``).
The cross-rank check's own errors, :class:`~ringpipe.check.call.MismatchError` and
:class:`~ringpipe.check.call.InvalidCallError`, are raised by the communicators too; a call made
through the engine raises them as the engine's (:class:`EngineMismatchError`,
:class:`EngineInvalidCallError`), which are also :class:`HorovodInternalError` s.
"""

from __future__ import annotations

from ringpipe.check.call import InvalidCallError, MismatchError

__all__ = [
    "EngineError",
    "EngineInvalidCallError",
    "EngineMismatchError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "JoinError",
    "NotInitializedError",
    "from_transport",
]


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's name): ranks disagreed, a peer was lost, a set was foreign."""


class EngineError(HorovodInternalError):
    """A queued collective failed on the engine thread; the message carries the original error."""


class EngineMismatchError(MismatchError, EngineError):
    """Ranks made different calls; raised by the handle of every rank's call."""


class EngineInvalidCallError(InvalidCallError, EngineError):
    """Some rank's call was invalid; raised by the handle of every rank's call."""


class JoinError(EngineError):
    """A collective was called while a rank had joined, and joined ranks cannot take part in it."""


class NotInitializedError(ValueError):
    """An API call was made before :func:`ringpipe.init` (or after :func:`ringpipe.shutdown`)."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Hosts were added or removed: raised by ``state.commit()`` / ``check_host_updates()`` on every rank at once.

    ``skip_sync``: the new world only lost workers, so the survivors' state needs no sync.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


def from_transport(exc: BaseException) -> HorovodInternalError | None:
    """Horovod's error for a transport's failure in a collective, else None.

    Gloo and c10d raise a plain ``RuntimeError`` (or a ``torch.distributed.DistError``) when a
    collective times out or its connections break; Horovod's ``synchronize`` raises every such
    failure as :class:`HorovodInternalError`, which is what ``hvd.elastic.run`` recovers from.
    ringpipe's own errors (a lost peer named, a mismatch) pass through unchanged.
    """
    if type(exc) is RuntimeError or any(c.__name__ == "DistError" for c in type(exc).__mro__):
        return HorovodInternalError(f"a collective failed in the transport: {exc}")
    return None
