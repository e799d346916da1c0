import tensorflow as _tf

import ringpipe.tensorflow as _rp
from ringpipe.tensorflow import *  # noqa

_executing_eagerly = _tf.executing_eagerly  # SHIM: Horovod-internal helper
def __getattr__(name):
    return getattr(_rp, name)
