import contextlib as _contextlib
import os as _os

from packaging import version as _v


def is_version_greater_equal_than(ver, target):  # SHIM: helper, same semantics as Horovod's
    return _v.parse(ver) >= _v.parse(target)



@_contextlib.contextmanager
def env(**kwargs):  # SHIM: test helper, sets environment variables for the block (same semantics as Horovod's)
    saved = {k: _os.environ.get(k) for k in kwargs}
    _os.environ.update({k: str(v) for k, v in kwargs.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                _os.environ.pop(k, None)
            else:
                _os.environ[k] = v
