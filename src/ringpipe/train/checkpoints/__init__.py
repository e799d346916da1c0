"""The trainer's checkpoints: the files, what a run saves and restores, the best one, resuming on another world.

* :mod:`~ringpipe.train.checkpoints.files`: checkpoint files, written atomically and checksummed,
  the last k kept, the newest good one found for ``--resume``.
* :mod:`~ringpipe.train.checkpoints.checkpointer`: what a checkpoint holds of a run, and how the
  training loop saves it and restores it (:class:`Checkpointer`).
* :mod:`~ringpipe.train.checkpoints.best`: the best checkpoint by a chosen metric (``checkpoint.best``).
* :mod:`~ringpipe.train.checkpoints.resize`: resuming a data-parallel run on another number of ranks.
* :mod:`~ringpipe.train.checkpoints.resume_checks`: what ``ringpipe train --resume`` checks before
  any process starts.

Nothing is imported here, so that the command line's checks do not import torch.
"""

__all__: list[str] = []
