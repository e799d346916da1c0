"""A graph op that fails with a chosen TensorFlow error code: how a collective's error leaves a graph typed.

Inside a graph a collective runs in a ``tf.py_function`` node, and TensorFlow turns an exception
raised there into an error code by its Python type alone (``tensorflow/python/lib/core/py_func.cc``):
``ValueError``/``TypeError`` become ``InvalidArgument``, ``StopIteration`` ``OutOfRange``,
``MemoryError`` ``ResourceExhausted``, ``NotImplementedError`` ``Unimplemented``, and everything
else, ``tf.errors.OpError`` subclasses included, ``Unknown``. Horovod's ops fail a graph with
``FailedPrecondition`` when ranks made different calls and ``InvalidArgument`` when a call is invalid.

So the node does not raise those errors: it files the error under a ticket (an ``int64``, 0 when
all went well) and returns the ticket beside its outputs; a ``RingpipeStatus`` node takes the
ticket and fails the graph with the error's own code and message; the collective's outputs are
read through ``tf.identity`` nodes that wait for it. ``RingpipeStatus`` is registered at run time
through TensorFlow's stable C API (``tensorflow/c/kernels.h``, ``ops.h``), its kernel a Python
function called through ``ctypes``; nothing is compiled. Where that API cannot be reached,
:func:`available` is false and the node raises as before (the caller sees ``UnknownError``
carrying the same message).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from typing import Any

import tensorflow as tf

__all__ = ["available", "file_error", "status_node"]

_OP = "RingpipeStatus"
_void = ctypes.c_void_p
_COMPUTE = ctypes.CFUNCTYPE(None, _void, _void)

_lock = threading.Lock()
_tickets = itertools.count(1)
_filed: dict[int, tuple[int, str]] = {}
_lib: Any = None
_kernel: Any = None  # the ctypes callback, kept alive as long as the process
_state: bool | None = None


def _bind(lib: Any) -> None:
    """Declare the C functions used (``tensorflow/c/tf_status.h``, ``tf_tensor.h``, ``kernels.h``, ``ops.h``)."""
    sig = {
        "TF_NewStatus": ([], _void),
        "TF_DeleteStatus": ([_void], None),
        "TF_GetCode": ([_void], ctypes.c_int),
        "TF_Message": ([_void], ctypes.c_char_p),
        "TF_SetStatus": ([_void, ctypes.c_int, ctypes.c_char_p], None),
        "TF_NewOpDefinitionBuilder": ([ctypes.c_char_p], _void),
        "TF_OpDefinitionBuilderAddInput": ([_void, ctypes.c_char_p], None),
        "TF_OpDefinitionBuilderSetIsStateful": ([_void, ctypes.c_bool], None),
        "TF_RegisterOpDefinition": ([_void, _void], None),
        "TF_NewKernelBuilder": ([ctypes.c_char_p, ctypes.c_char_p, _void, _COMPUTE, _void], _void),
        "TF_RegisterKernelBuilder": ([ctypes.c_char_p, _void, _void], None),
        "TF_GetInput": ([_void, ctypes.c_int, ctypes.POINTER(_void), _void], None),
        "TF_TensorData": ([_void], _void),
        "TF_DeleteTensor": ([_void], None),
        "TF_OpKernelContext_Failure": ([_void, _void], None),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def _compute(_kernel_state: Any, ctx: Any) -> None:
    """The kernel: fail the node with the error filed under the input ticket, if any."""
    lib = _lib
    status = lib.TF_NewStatus()
    try:
        tensor = _void()
        lib.TF_GetInput(ctx, 0, ctypes.byref(tensor), status)
        if lib.TF_GetCode(status) != 0:
            lib.TF_OpKernelContext_Failure(ctx, status)
            return
        ticket = ctypes.c_int64.from_address(lib.TF_TensorData(tensor)).value
        lib.TF_DeleteTensor(tensor)
        if ticket == 0:
            return
        with _lock:
            code, message = _filed.pop(ticket, (13, f"ringpipe: no error filed under ticket {ticket}"))
        lib.TF_SetStatus(status, code, message.encode("utf-8", "replace"))
        lib.TF_OpKernelContext_Failure(ctx, status)
    finally:
        lib.TF_DeleteStatus(status)


def _register() -> bool:
    global _lib, _kernel
    from tensorflow.python.framework import op_def_registry

    if op_def_registry.get(_OP) is not None:  # registered by this process already
        return _lib is not None
    lib = ctypes.CDLL(os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2"))
    _bind(lib)
    _lib = lib
    _kernel = _COMPUTE(_compute)
    status = lib.TF_NewStatus()
    try:
        builder = lib.TF_NewOpDefinitionBuilder(_OP.encode())
        lib.TF_OpDefinitionBuilderAddInput(builder, b"ticket: int64")
        lib.TF_OpDefinitionBuilderSetIsStateful(builder, True)  # never folded, pruned or merged
        lib.TF_RegisterOpDefinition(builder, status)
        if lib.TF_GetCode(status) != 0:
            return False
        kernel = lib.TF_NewKernelBuilder(_OP.encode(), b"CPU", None, _kernel, None)
        lib.TF_RegisterKernelBuilder(_OP.encode(), kernel, status)
        return lib.TF_GetCode(status) == 0
    finally:
        lib.TF_DeleteStatus(status)


@tf.autograph.experimental.do_not_convert
def available() -> bool:
    """Whether ``RingpipeStatus`` can be built (registered on first call).

    Never converted by AutoGraph: converted, ``_register`` would bind the kernel's ``ctypes``
    callback to a local name, which is freed while TensorFlow still calls it (a crash at the
    graph's first run).
    """
    global _state
    with _lock:
        if _state is None:
            try:
                _state = _register()
            except (OSError, AttributeError):  # no libtensorflow_framework, or a C API without these functions
                _state = False
        return _state


def file_error(exc: tf.errors.OpError) -> tf.Tensor:
    """File ``exc`` (its code and message) for a ``RingpipeStatus`` node; the ticket to hand it."""
    with _lock:
        ticket = next(_tickets)
        _filed[ticket] = (int(exc.error_code), str(exc.message))
    return tf.constant(ticket, tf.int64)


def status_node(ticket: tf.Tensor, name: str) -> Any:
    """A ``RingpipeStatus`` node of the current graph, failing it with the error filed under ``ticket``."""
    return tf.compat.v1.get_default_graph().create_op(_OP, [ticket], [], name=f"{name}Status")
