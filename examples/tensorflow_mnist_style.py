"""Seed 002's TensorFlow 2 + Horovod ``GradientTape`` program on ringpipe: only the import line changes.

Runs on the 8x8 handwritten digits that ringpipe ships (no download). Start it with

    ringpipe launch -n 2 examples/tensorflow_mnist_style.py --epochs 4

(or ``mpirun -np 2 python examples/tensorflow_mnist_style.py``). The seven Horovod steps are marked.
The training step runs inside ``tf.function``; the first batch broadcasts the variables (step 5)
after the optimizer has created its own, as Horovod's TensorFlow 2 example does. What Keras 3
changed from the seed's program: ``optimizer.variables`` is a list, not a method, and
``tf.train.Checkpoint`` takes the Keras model and optimizer as they are.
"""

import argparse
import os
import time

import keras
import numpy as np
import tensorflow as tf

import ringpipe.tensorflow as hvd  # was: import horovod.tensorflow as hvd
from ringpipe.train.datasets import digits_arrays  # the 8x8 digits, shipped with ringpipe

parser = argparse.ArgumentParser(description="CNN on the digits with ringpipe (Horovod's TensorFlow API)")
parser.add_argument("--batch_size", type=int, default=32, help="per-rank batch size")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--checkpoint_dir", default="", help="write a tf.train.Checkpoint per epoch here (rank 0)")
args = parser.parse_args()

# 1. Initialize Horovod
hvd.init()

# 2. Pin one GPU per process (none on a CPU machine)
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

# 7. Each rank reads its shard of the data
images, y = digits_arrays()  # float32 pixel counts 0..16, int64 labels
x = images[..., None] / np.float32(16.0)
dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank())
           .shuffle(2048, seed=1234).batch(args.batch_size))

keras.utils.set_random_seed(1234 + hvd.rank())  # different on purpose: step 5 makes them equal
model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
    keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10),
])
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# 3. Scale the learning rate by the number of workers
opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)

checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    # 4. Wrap the tape: gradient() returns the gradients averaged over ranks
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    # 5. Broadcast the initial variables from rank 0, once the optimizer has made its own
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 3: a list (was opt.variables())
    return loss


t0 = time.time()
first = True
for epoch in range(args.epochs):
    # 8. Steps per epoch follow from the shard: nsamples / size / batch_size
    losses = []
    for images, labels in dataset:
        losses.append(training_step(images, labels, first))
        first = False
    mean = hvd.allreduce(tf.reduce_mean(tf.stack(losses)), name="epoch_loss")  # averaged over ranks
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1}: loss {float(mean):.4f}")
        # 6. Checkpoint on rank 0 only
        if args.checkpoint_dir:
            checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))
# every rank trained the same weights (one sum per rank, gathered)
sums = hvd.allgather_object(float(sum(tf.reduce_sum(tf.cast(v, tf.float64)) for v in model.variables)))
if hvd.rank() == 0:
    print(f"Hvd Procs {hvd.size()} Total time: {time.time() - t0} second")
    print(f"weights equal on every rank: {len(set(sums)) == 1}")
    logits = model(x, training=False)
    acc = float(tf.reduce_mean(tf.cast(tf.argmax(logits, axis=1) == y, tf.float32)))
    print(f"accuracy on all digits: {acc:.3f}")
hvd.shutdown()
