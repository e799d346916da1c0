"""horovod.torch -> ringpipe (star + any attribute via __getattr__); no behaviour here."""
import ringpipe as _rp
from ringpipe import *  # noqa


def __getattr__(name):
    return getattr(_rp, name)
