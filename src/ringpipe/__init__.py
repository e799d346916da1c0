"""ringpipe: distributed deep-learning training on PyTorch.

``import ringpipe as hvd`` gives the Horovod-style API (``init``, ``rank``, ``allreduce``,
``DistributedOptimizer``, ...); the communicator layer, the launcher, the pipeline engine and
the trainer live in the subpackages.
"""

from ringpipe.api import *  # noqa: F403 - the Horovod-style API is the top level
from ringpipe.api import __all__ as _api_all
from ringpipe.comm import CommError, Communicator, ReduceOp, comm_stats, init_world, shutdown_world
from ringpipe.env import Topology, detect
from ringpipe.launch import local_rank_zero_first, spawn
from ringpipe.pipeline import PipelineTrainer

__version__ = "0.1.0"

__all__ = list(_api_all)
__all__ += [
    "CommError",
    "Communicator",
    "PipelineTrainer",
    "ReduceOp",
    "Topology",
    "comm_stats",
    "detect",
    "init_world",
    "local_rank_zero_first",
    "shutdown_world",
    "spawn",
]
