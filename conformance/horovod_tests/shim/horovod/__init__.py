"""Conformance shim: `horovod.*` imports used by Horovod's own tests resolve to ringpipe.

Shimmed names (all re-exports unless stated):
  horovod.torch                 -> ringpipe (star + any attribute via __getattr__)
  horovod.tensorflow            -> ringpipe.tensorflow (star + any attribute via __getattr__)
      _executing_eagerly        -> SHIM (Horovod internal helper) = tf.executing_eagerly
  horovod.tensorflow.util       -> SHIM: _executing_eagerly = tf.executing_eagerly (Horovod internal)
  horovod.tensorflow.keras      -> ringpipe.tensorflow.keras (incl. .callbacks, .elastic)
  horovod.keras                 -> ringpipe.keras (incl. .callbacks, .elastic)
  horovod.common.util.is_version_greater_equal_than -> SHIM (pure version compare helper)
  horovod.runner.util.threads.in_thread -> SHIM (thread starter used by tests/utils/common.py)
"""
