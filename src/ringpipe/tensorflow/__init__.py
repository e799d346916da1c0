"""Horovod's ``horovod.tensorflow`` API for TensorFlow 2 on ringpipe's engine: ``import ringpipe.tensorflow as hvd``.

The process state (``init``, ranks, process sets), the collectives and the errors are
:mod:`ringpipe.core`'s, which the torch face calls too: a program may use both faces on one world.
Tensors cross to torch at the boundary (:mod:`ringpipe.tensorflow.bridge`); every call is
announced across ranks (:mod:`ringpipe.check`), so ranks that disagree (dtype, shape, op, root rank, set) all raise the same
:class:`HorovodInternalError` instead of hanging. Every op runs eagerly and inside ``tf.function``.
"""

try:
    import tensorflow as _tf  # noqa: F401 - fails early with the fix
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ringpipe.tensorflow needs TensorFlow: pip install 'ringpipe[tensorflow]' (or pip install "
        "tensorflow-cpu==2.21.0, which pulls no CUDA packages)"
    ) from exc

from ringpipe.core.basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    NotInitializedError,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    gpu_available,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
)
from ringpipe.core.timeline import start_timeline, stop_timeline

from . import elastic
from .compression import Compression
from .functions import (
    allgather_object,
    broadcast_,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .hooks import BroadcastGlobalVariablesHook, broadcast_global_variables
from .mpi_ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reducescatter,
)
from .optimizer import DistributedOptimizer
from .queries import (
    check_num_rank_power_of_2,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from .sync_batch_norm import SyncBatchNormalization

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer", "HorovodInternalError",
    "Max", "Min", "NotInitializedError", "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_", "broadcast_object", "broadcast_object_fn", "broadcast_variables", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gpu_available", "gloo_enabled",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init", "is_initialized", "join",
    "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op", "reducescatter",
    "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline", "stop_timeline",
    "BroadcastGlobalVariablesHook", "SyncBatchNormalization", "broadcast_global_variables", "is_homogeneous",
    "check_num_rank_power_of_2",
]
