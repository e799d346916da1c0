import sys as _sys

import ringpipe.tensorflow.keras as _rp
from ringpipe.tensorflow.keras import *  # noqa

callbacks = _rp.callbacks
elastic = _rp.elastic
_sys.modules[__name__ + ".callbacks"] = _rp.callbacks
_sys.modules[__name__ + ".elastic"] = _rp.elastic
def __getattr__(name):
    return getattr(_rp, name)
