from packaging import version as _v
def is_version_greater_equal_than(ver, target):  # SHIM: helper, same semantics as Horovod's
    return _v.parse(ver) >= _v.parse(target)
