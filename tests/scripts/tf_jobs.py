"""Several TensorFlow rank scripts of this folder in one job: TensorFlow's and torch's start-up paid once per rank.

Run as ``tf_jobs.py OUT NAME [NAME ...]`` under ``ringpipe launch`` or ``mpirun``. Each ``NAME`` is
a rank script of ``tests/scripts`` (without ``.py``) with a ``main(out_dir)``; they run in turn, in
this one process, each writing its ``rank<R>.json`` into ``OUT/NAME``, as it would alone. Between
two scripts the job leaves what a fresh interpreter would find: ringpipe shut down (a script that
does not call ``hvd.shutdown()`` itself), a fresh Keras session (layer names from zero) and an empty
TF1 default graph. A script that fails ends the job with a line naming it; the scripts before it
have written their results (``tests/tf_ranks.py``'s :class:`~tf_ranks.TFJobs` reads them).
"""

import importlib
import os
import sys


def fresh() -> None:
    """What the next script would find in a new interpreter: no ringpipe world, no Keras names, no TF1 graph."""
    import tensorflow as tf

    import ringpipe.tensorflow as hvd

    if hvd.is_initialized():
        hvd.shutdown()
    tf.keras.backend.clear_session()
    tf.compat.v1.reset_default_graph()


def main(out: str, names: list[str]) -> None:
    for name in names:
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        try:
            importlib.import_module(name).main(folder)
            fresh()
        except BaseException:
            print(f"tf_jobs: {name} failed; the scripts after it did not run", file=sys.stderr, flush=True)
            raise


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
