"""``hvd.elastic.run`` on TensorFlow: a collective failing inside ``tf.function`` rolls back to the last commit.

Run under ``ringpipe launch -n N`` or ``mpirun -n N`` (``RINGPIPE_BACKEND=mpi``); writes
``rank<R>.json`` into the folder given as argument. Three training steps, one per "epoch", with
a commit after each; in the first attempt a graph node raises the error a collective raises when
a peer departs, after the second step and before its commit.
"""

import json
import os
import sys

import keras
import tensorflow as tf
from tf_more import GLOBAL_BATCH, LR, MOMENTUM, STEPS, data, model, shard, weights

import ringpipe.keras as hvd
import ringpipe.tensorflow as htf


def main(out_dir):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = data(6)
    xs, ys = shard(x, r, n), shard(y, r, n)
    per = GLOBAL_BATCH // n
    out = {"rank": r, "size": n, "mpi": hvd.mpi_enabled()}
    # hvd.elastic.run: a collective failing inside tf.function rolls back to the last commit and re-initialises
    net2 = model(700 + r)
    opt2 = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    opt2.build(net2.trainable_variables)
    state2 = hvd.elastic.KerasState(net2, opt2, epoch=0)
    resets, attempts = [], []
    state2.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @tf.function
    def step2(bx, by):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net2(bx) - by))
        grads = htf.DistributedGradientTape(tape).gradient(loss, net2.trainable_variables)
        opt2.apply_gradients(zip(grads, net2.trainable_variables, strict=True))

    def lost_peer():
        raise htf.HorovodInternalError("a peer departed")  # what a collective raises when a rank dies

    fail = tf.function(lambda: tf.py_function(lost_peer, [], tf.int32))

    @hvd.elastic.run
    def train(st):
        attempts.append(st.epoch)
        for epoch in range(st.epoch, STEPS):
            step2(xs[epoch * per : (epoch + 1) * per], ys[epoch * per : (epoch + 1) * per])
            if epoch == 1 and len(attempts) == 1:
                fail()  # the error surfaces as a TensorFlow error from the graph
            st.epoch = epoch + 1
            st.commit()
        return st.epoch

    out["run"] = {"returned": train(state2), "attempts": attempts, "resets": resets, "weights": weights(net2),
                  "iterations": int(opt2.iterations.numpy())}

    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
