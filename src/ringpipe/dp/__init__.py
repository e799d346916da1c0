"""Data parallelism: background engine, DistributedOptimizer, broadcasts, sharding, join, SyncBatchNorm, LR warmup."""

from ringpipe.dp.announce import JoinError
from ringpipe.dp.broadcast import broadcast_optimizer_state, broadcast_parameters
from ringpipe.dp.checkpoint import load_checkpoint, save_checkpoint
from ringpipe.dp.compression import Compression, Compressor
from ringpipe.dp.engine import Engine, EngineError, Handle
from ringpipe.dp.join import join
from ringpipe.dp.lr import GradualWarmup, scale_lr
from ringpipe.dp.optimizer import DEFAULT_BUCKET_BYTES, DistributedOptimizer
from ringpipe.dp.sampler import DistributedSampler
from ringpipe.dp.sync_batchnorm import SyncBatchNorm

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
