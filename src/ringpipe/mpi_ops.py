"""``horovod.torch.mpi_ops`` under ringpipe: the collectives, reduce ops and handles of ``import ringpipe as hvd``.

Programs that import from Horovod's module rather than its package
(``from horovod.torch.mpi_ops import allreduce_async, synchronize``) run with that import
changed to ``from ringpipe.mpi_ops import ...``. Nothing here but re-exports of
:mod:`ringpipe.api`, and ``_basics``, the one internal Horovod's own tests read (the registered
process sets and their ranks).
"""

from ringpipe.api.basics import *  # noqa: F403
from ringpipe.api.basics import __all__ as _basic_names
from ringpipe.api.movement import *  # noqa: F403
from ringpipe.api.movement import __all__ as _movement
from ringpipe.api.reductions import *  # noqa: F403
from ringpipe.api.reductions import __all__ as _reductions
from ringpipe.dp.engine import Handle as Handle
from ringpipe.dp.process_sets import basics as _basics  # noqa: F401 - Horovod internal, read by its tests

__all__ = sorted({*_basic_names, *_movement, *_reductions, "Handle"})
