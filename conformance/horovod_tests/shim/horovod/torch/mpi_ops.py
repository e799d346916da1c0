"""horovod.torch.mpi_ops -> ringpipe.mpi_ops (re-exports only)."""
import ringpipe.mpi_ops as _rp
from ringpipe.mpi_ops import *  # noqa


def __getattr__(name):
    return getattr(_rp, name)
