"""The one helper Horovod's process-set tests import from ``horovod.runner.common.util.env``.  # SHIM

The rank and size a launcher gave this process, read from the first pair of variables present:
horovodrun's (``HOROVOD_RANK``/``HOROVOD_SIZE``, which ringpipe launch also sets), Open MPI's,
then PMI's; rank 0 of 1 when there are none; an error when only half of a pair is set.
"""
import os

_PAIRS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
          ("PMI_RANK", "PMI_SIZE"))


def get_env_rank_and_size():
    for rank_name, size_name in _PAIRS:
        rank, size = os.environ.get(rank_name), os.environ.get(size_name)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of {rank_name} and "
                               f"{size_name} found in environment")
    return 0, 1
