import tensorflow as _tf

_executing_eagerly = _tf.executing_eagerly  # SHIM: Horovod-internal helper
