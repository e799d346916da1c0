"""The Horovod-style top-level API: ``import ringpipe as hvd`` runs a ``horovod.torch`` script.

The naming grid follows Horovod: ``op`` returns a new tensor (differentiable), ``op_`` works in
place, ``op_async`` / ``op_async_`` return a :class:`~ringpipe.dp.engine.Handle` to pass to
``synchronize(handle)`` (which returns the result) or ``poll(handle)``. Every collective takes
``process_set=``; the process state (the world communicator, its engine, the process sets)
lives once in :mod:`ringpipe.dp.world`, below this face. Every call is compared across ranks
before data moves: ranks that disagree (dtype, shape, op, root rank, scale factors, process set)
all raise the same :class:`HorovodInternalError`. Operations with a ``name=`` match across ranks
by that name, as in Horovod; a name still in flight raises :class:`ValueError` on its rank.
"""

from ringpipe.dp.announce import JoinError as JoinError
from ringpipe.dp.broadcast import broadcast_parameters as broadcast_parameters
from ringpipe.dp.checkpoint import load_checkpoint as load_checkpoint
from ringpipe.dp.checkpoint import save_checkpoint as save_checkpoint
from ringpipe.dp.compression import Compression as Compression
from ringpipe.dp.engine import Handle as Handle
from ringpipe.dp.lr import GradualWarmup as GradualWarmup
from ringpipe.dp.lr import scale_lr as scale_lr
from ringpipe.dp.optimizer import DistributedOptimizer as DistributedOptimizer
from ringpipe.dp.sampler import DistributedSampler as DistributedSampler
from ringpipe.dp.sync_batchnorm import SyncBatchNorm as SyncBatchNorm

from . import basics, elastic, movement, reductions  # noqa: F401 - elastic: hvd.elastic.run, TorchState
from .basics import *  # noqa: F403 - re-exported as the API
from .basics import _world  # noqa: F401 - kept for code that reached the world through the API
from .movement import *  # noqa: F403
from .reductions import *  # noqa: F403

__all__ = sorted({
    *basics.__all__,
    *movement.__all__,
    *reductions.__all__,
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
})
