"""``horovod.torch.mpi_ops`` under ringpipe: the collectives, reduce ops and handles of ``import ringpipe as hvd``.

Programs that import from Horovod's module rather than its package
(``from horovod.torch.mpi_ops import allreduce_async, synchronize``) run with that import
changed to ``from ringpipe.mpi_ops import ...``. It belongs to the torch face: nothing here but
re-exports of what :mod:`ringpipe.api` re-exports from :mod:`ringpipe.core` (and its ``join``), and ``_basics``, the one internal Horovod's own tests read (the registered
process sets and their ranks).
"""

from ringpipe.api.data_parallel import *  # noqa: F403
from ringpipe.api.data_parallel import __all__ as _data_parallel
from ringpipe.core.basics import *  # noqa: F403
from ringpipe.core.basics import __all__ as _basic_names
from ringpipe.core.engine import Handle as Handle
from ringpipe.core.movement import *  # noqa: F403
from ringpipe.core.movement import __all__ as _movement
from ringpipe.core.process_sets import basics as _basics  # noqa: F401 - Horovod internal, read by its tests
from ringpipe.core.reductions import *  # noqa: F403
from ringpipe.core.reductions import __all__ as _reductions
from ringpipe.core.timeline import start_timeline as start_timeline
from ringpipe.core.timeline import stop_timeline as stop_timeline

__all__ = sorted({*_basic_names, *_movement, *_reductions, *_data_parallel, "Handle", "start_timeline",
                  "stop_timeline"})
