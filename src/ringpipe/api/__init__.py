"""The Horovod-style top-level API: ``import ringpipe as hvd`` runs a ``horovod.torch`` script.

The naming grid follows Horovod: ``op`` returns a new tensor (differentiable), ``op_`` works in
place, ``op_async`` / ``op_async_`` return a :class:`~ringpipe.core.engine.Handle` to pass to
``synchronize(handle)`` (which returns the result) or ``poll(handle)``. Every collective takes
``process_set=``. The process state (the world communicator, its engine, the process sets), the
collectives and their errors live once in :mod:`ringpipe.core`, below this face and shared with
the TensorFlow and Keras faces; this package re-exports them with the torch-only names
(``DistributedOptimizer``, ``join``, ``broadcast_optimizer_state``, ``TorchState``...). Every call
is compared across ranks before data moves: ranks that disagree (dtype, shape, op, root rank,
scale factors, process set) all raise the same :class:`HorovodInternalError`. Operations with a ``name=`` match across ranks
by that name, as in Horovod; a name still in flight raises :class:`ValueError` on its rank.
"""

from ringpipe.core import basics, movement, reductions
from ringpipe.core.basics import *  # noqa: F403 - re-exported as the API
from ringpipe.core.basics import _world  # noqa: F401 - kept for code that reached the world through the API
from ringpipe.core.compression import Compression as Compression
from ringpipe.core.engine import Handle as Handle
from ringpipe.core.errors import JoinError as JoinError
from ringpipe.core.movement import *  # noqa: F403
from ringpipe.core.reductions import *  # noqa: F403
from ringpipe.core.timeline import start_timeline as start_timeline
from ringpipe.core.timeline import stop_timeline as stop_timeline
from ringpipe.dp.broadcast import broadcast_parameters as broadcast_parameters
from ringpipe.dp.checkpoint import load_checkpoint as load_checkpoint
from ringpipe.dp.checkpoint import save_checkpoint as save_checkpoint
from ringpipe.dp.lr import GradualWarmup as GradualWarmup
from ringpipe.dp.lr import scale_lr as scale_lr
from ringpipe.dp.optimizer import DistributedOptimizer as DistributedOptimizer
from ringpipe.dp.sampler import DistributedSampler as DistributedSampler
from ringpipe.dp.sync_batch_norm import SyncBatchNorm as SyncBatchNorm

from . import data_parallel, elastic  # noqa: F401 - elastic: hvd.elastic.run, TorchState
from .data_parallel import broadcast_optimizer_state as broadcast_optimizer_state
from .data_parallel import join as join

__all__ = sorted({
    *basics.__all__,
    *movement.__all__,
    *reductions.__all__,
    *data_parallel.__all__,
    "Compression",
    "DistributedOptimizer",
    "DistributedSampler",
    "GradualWarmup",
    "Handle",
    "JoinError",
    "SyncBatchNorm",
    "broadcast_parameters",
    "elastic",
    "load_checkpoint",
    "save_checkpoint",
    "scale_lr",
    "start_timeline",
    "stop_timeline",
})
