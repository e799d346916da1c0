"""The regression problem the TensorFlow rank scripts train on, and the rows each rank takes.

Shared by the rank scripts and by the tests' one-process references, so that both sides see the
same global batches: ``y = x @ [1, -2, 0.5, 3] + 0.1`` on normal inputs with 4 features.
"""

import numpy as np


def regression(global_batch, steps, seed):
    """``steps`` global batches of ``global_batch`` rows, one after the other: ``(x, y)``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(global_batch * steps, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32") + 0.1)[:, None]
    return x, y


def shard(a, r, n, global_batch, steps):
    """Rank ``r``'s rows of every global batch (``global_batch / n`` each, in rank order)."""
    per = global_batch // n
    return np.concatenate([a[k * global_batch + r * per : k * global_batch + (r + 1) * per] for k in range(steps)])
