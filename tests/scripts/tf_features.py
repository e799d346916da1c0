"""ringpipe.tensorflow's SyncBatchNormalization, is_homogeneous and TF1 session hook on this rank.

Run under ``ringpipe launch -n 3``. SyncBatchNormalization: rank ``r`` normalises rows
``ROWS[r]`` of :func:`batch` (a different number of rows on each rank), eagerly and inside
``tf.function``, 2-D and 4-D; writes its outputs, gradients and moving statistics. The hook: a
``tf.compat.v1`` graph whose variable starts at ``rank + 1`` on each rank, trained in a
``MonitoredTrainingSession`` with ``BroadcastGlobalVariablesHook(0)``. Writes ``rank<R>.json``.
"""

import json
import os
import sys

import tensorflow as tf
from tf_problem import sync_bn_case

import ringpipe
import ringpipe.tensorflow as hvd

BOUNDS = [0, 2, 5, 9]  # rank r owns rows BOUNDS[r]:BOUNDS[r + 1] of the global batch
MOMENTUM, EPSILON = 0.9, 1e-3


def sync_bn(r, shape, seed, compiled):
    layer = hvd.SyncBatchNormalization(momentum=MOMENTUM, epsilon=EPSILON)
    return sync_bn_case(layer, BOUNDS, r, shape, seed, compiled)


def session_hook(r):
    """w starts at r + 1; the hook gives rank 0's; 3 steps of SGD on the mean of the ranks' losses."""
    seen = []
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([r + 1.0, 2.0 * (r + 1)]))
        target = tf.constant([float(r), -float(r)])
        loss = tf.reduce_sum(tf.square(w - target))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        train = opt.minimize(loss, global_step=step)
        hooks = [hvd.BroadcastGlobalVariablesHook(0), tf.compat.v1.train.StopAtStepHook(last_step=4)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            seen.append(sess.run(w).tolist())  # after the broadcast
            for _ in range(3):
                sess.run(train)
                seen.append(sess.run(w).tolist())
    try:
        hvd.broadcast_global_variables(0)
        eager = "no error"
    except RuntimeError as exc:
        eager = str(exc)
    return {"w": seen, "eager": eager}


def main(out_dir):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r, "size": n, "homogeneous": {
        "tf": hvd.is_homogeneous(), "api": ringpipe.is_homogeneous(),
        "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}}
    out["sync_bn"] = {
        f"{name}-{'function' if compiled else 'eager'}": sync_bn(r, shape, seed, compiled)
        for name, shape, seed in (("2d", (3,), 10), ("4d", (2, 2, 3), 20))
        for compiled in (False, True)
    }
    out["hook"] = session_hook(r)
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
