"""A job's key-value store that may be opened only when first needed.

The stall inspector and the departures watchdog keep their records in the job's key-value store
(``set``/``get``/``check``/``add``): the c10d store of the process group, or under MPI a store
served by rank 0 that the other ranks connect to on first use, so that a job that never needs it
pays nothing. :class:`LazyStore` holds either the store itself or the function that opens it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class LazyStore:
    """A store, or a function that opens one on the first :meth:`get`; opened at most once.

    ``on_failure`` is called with the exception when the opener fails; :meth:`get` then returns
    None from that call on (the callers fall back to what they can say without the store).
    """

    def __init__(self, store_or_opener: Any, on_failure: Callable[[Exception], None]) -> None:
        self._value = store_or_opener
        self._on_failure = on_failure
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The store; None when there is none or it cannot be reached."""
        with self._lock:
            if callable(self._value) and not hasattr(self._value, "set"):
                opener, self._value = self._value, None
                try:
                    self._value = opener()
                except Exception as exc:  # noqa: BLE001 - the caller decides how much this matters
                    self._on_failure(exc)
            return self._value
