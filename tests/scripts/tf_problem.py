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


def bn_rows(total, shape, seed):
    """``total`` rows of shape ``shape`` for the SyncBatchNormalization cases (mean 1.5, deviation 2)."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(total, *shape)) * 2.0 + 1.5).astype("float32")


def sync_bn_case(layer, bounds, r, shape, seed, compiled):
    """``layer`` (a SyncBatchNormalization) on rank ``r``'s rows ``bounds[r]:bounds[r + 1]`` of :func:`bn_rows`.

    One training step, eagerly or inside ``tf.function``: the outputs, the gradients of
    ``sum(out * c)`` (``c`` from the next seed) for the input, gamma and beta, the moving
    statistics after it, and the layer's inference output (no communication).
    """
    import tensorflow as tf

    x = bn_rows(bounds[-1], shape, seed)[bounds[r] : bounds[r + 1]]
    c = bn_rows(bounds[-1], shape, seed + 1)[bounds[r] : bounds[r + 1]]
    layer.build(x.shape)
    layer.gamma.assign(np.linspace(0.5, 1.5, shape[-1]).astype("float32"))
    layer.beta.assign(np.linspace(-0.2, 0.3, shape[-1]).astype("float32"))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x, training=True)
            loss = tf.reduce_sum(out * c)
        return (out, *tape.gradient(loss, [x, layer.gamma, layer.beta]))

    out, gx, gg, gb = (tf.function(step) if compiled else step)(tf.constant(x))
    inference = layer(tf.constant(x), training=False)
    return {"class": type(layer).__mro__[1].__module__, "out": out.numpy().tolist(), "grad_x": gx.numpy().tolist(),
            "grad_gamma": gg.numpy().tolist(), "grad_beta": gb.numpy().tolist(),
            "moving_mean": layer.moving_mean.numpy().tolist(), "moving_variance": layer.moving_variance.numpy().tolist(),
            "inference": inference.numpy().tolist()}


def raised(fn):
    """``[exception class name, message]`` of what ``fn()`` raised, or None (reported to the test)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [type(exc).__name__, str(exc)]
    return None
