"""What every face shares: one engine under the torch, TensorFlow and Keras faces.

The faces (:mod:`ringpipe.api` for torch, :mod:`ringpipe.tensorflow`, :mod:`ringpipe.keras`) convert
tensors at their edge and call this package; none of them imports another, and nothing here
imports a face.

- :mod:`~ringpipe.core.world`: the process state, one per process (communicator, engine, process sets);
- :mod:`~ringpipe.core.process_sets`: Horovod's process sets;
- :mod:`~ringpipe.core.engine`: the background engine that runs queued collectives in order;
- :mod:`~ringpipe.core.basics`: ``init``, ``shutdown``, who am I, what is built, ``synchronize``;
- :mod:`~ringpipe.core.calls`, :mod:`~ringpipe.core.ops`, :mod:`~ringpipe.core.reductions`,
  :mod:`~ringpipe.core.movement`: the Horovod-style collectives on torch tensors, announced across
  ranks (:mod:`ringpipe.check`) and run on the engine; :mod:`~ringpipe.core.compression`, the wire
  compression they take;
- :mod:`~ringpipe.core.timeline`: the timeline hooks; :mod:`~ringpipe.core.elastic`: the elastic
  machinery (``run``, ``State``);
- :mod:`~ringpipe.core.errors`: the errors every face raises.

The modules are imported where they are used (the package imports only its errors), so that the
cross-rank check below the engine can import :mod:`ringpipe.core.engine` without the rest.
"""

from ringpipe.core.errors import (
    EngineError,
    EngineInvalidCallError,
    EngineMismatchError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    JoinError,
    NotInitializedError,
)

__all__ = [
    "EngineError",
    "EngineInvalidCallError",
    "EngineMismatchError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "JoinError",
    "NotInitializedError",
]
