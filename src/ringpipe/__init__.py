"""ringpipe: distributed deep-learning training on PyTorch."""

from ringpipe.comm import CommError, Communicator, ReduceOp, comm_stats, init_world, shutdown_world
from ringpipe.env import Topology, detect
from ringpipe.launch import local_rank_zero_first, spawn

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "Communicator",
    "ReduceOp",
    "Topology",
    "comm_stats",
    "detect",
    "init_world",
    "local_rank_zero_first",
    "shutdown_world",
    "spawn",
]
