"""Data parallelism: DistributedOptimizer, broadcasts, sharding, join, SyncBatchNorm, LR warmup, checkpoints.

The engine, its handles and errors, and the wire compression are :mod:`ringpipe.core`'s (every face
shares them); they are re-exported here, where data-parallel programs have always found them.
"""

from ringpipe.core.compression import Compression, Compressor
from ringpipe.core.engine import Engine, Handle
from ringpipe.core.errors import EngineError, JoinError
from ringpipe.dp.broadcast import broadcast_optimizer_state, broadcast_parameters
from ringpipe.dp.checkpoint import load_checkpoint, save_checkpoint
from ringpipe.dp.join import join
from ringpipe.dp.lr import GradualWarmup, scale_lr
from ringpipe.dp.optimizer import DEFAULT_BUCKET_BYTES, DistributedOptimizer
from ringpipe.dp.sampler import DistributedSampler
from ringpipe.dp.sync_batch_norm import SyncBatchNorm

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "DistributedSampler",
    "Engine",
    "EngineError",
    "GradualWarmup",
    "Handle",
    "JoinError",
    "SyncBatchNorm",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "join",
    "load_checkpoint",
    "save_checkpoint",
    "scale_lr",
]
