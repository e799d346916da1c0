"""Seed 002's Keras + Horovod CNN program on ringpipe: only the import line changes (plus what Keras 3 itself changed).

Runs on the 8x8 handwritten digits that ringpipe ships (no download). Start it with

    ringpipe launch -n 2 examples/tensorflow_keras_mnist_style.py --epochs 4 --warmup_epochs 1

(or ``mpirun -np 2 python examples/tensorflow_keras_mnist_style.py``). The seven Horovod steps are marked.
What Keras 3 changed from the seed's Keras 2 program: ``compile`` takes no
``experimental_run_tf_function``; ``ModelCheckpoint`` wants a ``.keras`` path;
``optimizer.variables`` is a list, not a method.
"""

import argparse
import os
import time

import keras
import numpy as np
import tensorflow as tf

import ringpipe.tensorflow.keras as hvd  # was: import horovod.tensorflow.keras as hvd
from ringpipe.train.datasets import digits_arrays  # the 8x8 digits, shipped with ringpipe

parser = argparse.ArgumentParser(description="Keras CNN on the digits with ringpipe (Horovod's Keras API)")
parser.add_argument("--batch_size", type=int, default=32, help="per-rank batch size")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--warmup_epochs", type=int, default=1)
parser.add_argument("--checkpoint_dir", default="", help="write a .keras checkpoint per epoch here (rank 0)")
args = parser.parse_args()

# 1. Initialize Horovod
hvd.init()

# 2. Pin one GPU per process (none on a CPU machine)
gpus = tf.config.experimental.list_physical_devices("GPU")
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

# 7. Each rank reads its shard of the data
images, y = digits_arrays()  # float32 pixel counts 0..16, int64 labels
x = images[..., None] / np.float32(16.0)
x_train, y_train = x[hvd.rank() :: hvd.size()], y[hvd.rank() :: hvd.size()]

keras.utils.set_random_seed(1234 + hvd.rank())  # different on purpose: step 5 makes them equal
model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
    keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Dropout(0.25),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])

# 3. Scale the learning rate by the number of workers; 4. wrap the optimizer
opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
opt = hvd.DistributedOptimizer(opt)
model.compile(loss="sparse_categorical_crossentropy", optimizer=opt, metrics=["accuracy"])

callbacks = [
    # 5. Broadcast the initial variables from rank 0
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Average the metrics over ranks at the end of each epoch
    hvd.callbacks.MetricAverageCallback(),
    # Gradual warmup from lr to lr * size (Goyal et al.)
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=args.lr * hvd.size(), warmup_epochs=args.warmup_epochs,
                                             verbose=1),
]
# 6. Checkpoint on rank 0 only
if hvd.rank() == 0 and args.checkpoint_dir:
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

t0 = time.time()
# 8. Steps per epoch follow from the shard: nsamples / size / batch_size
model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
          verbose=1 if hvd.rank() == 0 else 0)
if hvd.rank() == 0:
    print(f"Hvd Procs {hvd.size()} Total time: {time.time() - t0} second")
    loss, acc = model.evaluate(x, y, verbose=0)
    print(f"accuracy on all digits: {acc:.3f}")
hvd.shutdown()
