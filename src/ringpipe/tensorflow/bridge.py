"""Where TensorFlow meets the shared engine: tensors cross to torch and back, eagerly or from a graph.

Tensors cross by DLPack: a TF tensor becomes a torch view of the same buffer and a torch result
becomes a TF tensor without a copy (numpy is the fallback for what DLPack refuses). TensorFlow
treats its buffers as immutable, so a view of a TF tensor is only ever *read*: the shared collectives
(:mod:`ringpipe.core`) that the TF face calls copy their input before reducing into it.

Inside a graph (``tf.function``, Keras ``fit``) a collective becomes one ``tf.py_function`` node
that calls the engine when the graph runs. What that costs: the node takes the Python interpreter
(the GIL) while it runs, the graph cannot be compiled by XLA (``jit_compile=True``) nor exported
without Python (SavedModel), and each collective node of a graph waits for the previous one
(control dependencies in program order). The waiting keeps every rank's engine seeing the same
order of collectives, which the engine needs; the lists of gradients go through one node each
(one fused message per dtype), so a training step pays this once.

In a TF1 graph run by ``Session.run`` the waiting makes a run execute every collective node built
before the ones it fetches as well (TensorFlow cannot order two nodes only when both run): a
program that builds a collective, runs it, builds the next, runs it, and so on, pays for all the
earlier ones again in each run. Build the collectives first and then run them (a training step
built once), or use ``tf.function``, where every node runs once per call anyway.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import torch
from tensorflow.python.framework.ops import EagerTensor as _EagerTensor

try:  # the calls behind tf.experimental.dlpack.from_dlpack (see _import_dlpack)
    from tensorflow.python import pywrap_tfe as _pywrap_tfe
    from tensorflow.python.eager import context as _context
except ImportError:  # pragma: no cover - depends on the TensorFlow version
    _pywrap_tfe = _context = None

from ringpipe.core.errors import EngineInvalidCallError, EngineMismatchError
from ringpipe.core.process_sets import NotAMemberError, registered

from . import status_op

__all__ = ["graph_op", "to_torch", "to_tf", "run", "tf_dtype"]

_TORCH_OF_TF = {
    tf.float16: torch.float16, tf.bfloat16: torch.bfloat16, tf.float32: torch.float32, tf.float64: torch.float64,
    tf.int8: torch.int8, tf.int16: torch.int16, tf.int32: torch.int32, tf.int64: torch.int64, tf.uint8: torch.uint8,
    tf.uint16: torch.uint16,
    tf.bool: torch.bool, tf.complex64: torch.complex64, tf.complex128: torch.complex128,
}
_TF_OF_TORCH = {v: k for k, v in _TORCH_OF_TF.items()}
_TORCH_OF_ENUM = {d.as_datatype_enum: t for d, t in _TORCH_OF_TF.items()}


def _import_dlpack(capsule: Any) -> tf.Tensor:
    """``tf.experimental.dlpack.from_dlpack`` without its per-call context set-up once the context exists.

    A small collective is short enough that the code the bridge runs counts: between two calls the
    calling thread sleeps in the engine's wait, and on waking every function it enters is cold
    (at 4 KiB on two ranks, each TensorFlow call on the path costs tens of microseconds).
    """
    if _pywrap_tfe is None:
        return tf.experimental.dlpack.from_dlpack(capsule)
    ctx = _context.context()
    handle = getattr(ctx, "_context_handle", None)
    if handle is None:  # not initialized yet: the public call initializes it
        return tf.experimental.dlpack.from_dlpack(capsule)
    return _pywrap_tfe.TFE_FromDlpackCapsule(capsule, handle)


def graph_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a public op so that ``tf.function`` calls it as it is instead of converting it with AutoGraph.

    The ops branch only on Python values, so AutoGraph has nothing to convert; converting them
    would also convert the functions they define, the bodies of their ``tf.py_function`` nodes,
    which then run through AutoGraph's call wrapper on every execution of the graph (about a
    hundred wrapped calls per collective).

    Called eagerly, the op raises the engine's cross-rank errors as the TensorFlow errors
    Horovod raises (:func:`_tf_errors`). Building a graph, an op given a process set that is not
    registered raises its ``ValueError`` there and then, as the eager call does, instead of
    failing the graph when it runs.
    """
    wrapped = _tf_errors(fn)
    signature = inspect.signature(fn)
    if "process_set" in signature.parameters:

        def checked(*xs: Any, **kw: Any) -> Any:
            if not tf.executing_eagerly():
                registered(signature.bind_partial(*xs, **kw).arguments.get("process_set"), fn.__name__)
            return wrapped(*xs, **kw)

        return tf.autograph.experimental.do_not_convert(functools.wraps(fn)(checked))
    return tf.autograph.experimental.do_not_convert(functools.wraps(fn)(wrapped))


def tf_dtype(dtype: torch.dtype) -> tf.DType:
    return _TF_OF_TORCH[dtype]


def as_tensor(x: Any) -> tf.Tensor:
    """``tf.convert_to_tensor(x)``, skipped for what is already an eager tensor (most eager calls).

    The eager tensor class is imported by name: a tensor made at import to learn its type would
    start TensorFlow's runtime before the program could configure its threads and devices.
    """
    return x if type(x) is _EagerTensor else tf.convert_to_tensor(x)


def to_torch(x: Any) -> torch.Tensor:
    """A torch CPU tensor over ``x``'s buffer (read it, never write it); a copy only if DLPack refuses."""
    if type(x) is _EagerTensor and x._datatype_enum() in _TORCH_OF_ENUM:
        # An eager tensor of a supported dtype (the common case) goes straight through the DLPack
        # protocol: the fewest TensorFlow calls, which matters for small tensors (see _import_dlpack).
        try:
            return torch.from_dlpack(x)
        except Exception:  # noqa: BLE001 - fall back to the general path below
            pass
    t = as_tensor(x)
    if t.dtype not in _TORCH_OF_TF:
        raise TypeError(
            f"ringpipe.tensorflow: dtype {t.dtype.name} cannot take part in a collective; supported: "
            + ", ".join(sorted(d.name for d in _TORCH_OF_TF))
        )
    try:
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(t))
    except Exception:  # noqa: BLE001 - e.g. a tensor DLPack cannot describe; numpy copies it
        if t.dtype == tf.bfloat16:
            return torch.from_numpy(t.numpy().view("uint16").copy()).view(torch.bfloat16)
        return torch.from_numpy(t.numpy().copy())


def to_tf(t: torch.Tensor) -> tf.Tensor:
    """A TF tensor over a torch result's buffer (the torch tensor must not be written afterwards).

    A CUDA result stays on its GPU where TensorFlow has GPU support (DLPack carries the device);
    a TensorFlow without it gets a host copy.
    """
    t = t.detach().contiguous()
    if t.device.type == "cuda":
        try:
            return _import_dlpack(torch.utils.dlpack.to_dlpack(t))
        except Exception:  # noqa: BLE001 - a TensorFlow built without CUDA refuses a GPU capsule
            t = t.cpu()
    elif t.device.type != "cpu":
        t = t.cpu()
    try:
        return _import_dlpack(torch.utils.dlpack.to_dlpack(t))
    except Exception:  # noqa: BLE001 - e.g. an empty tensor; numpy copies it
        if t.dtype == torch.bfloat16:
            return tf.bitcast(tf.constant(t.view(torch.uint16).numpy()), tf.bfloat16)
        return tf.constant(t.numpy())


class MismatchedCallError(tf.errors.FailedPreconditionError, EngineMismatchError):
    """Ranks made different calls: TensorFlow's ``FailedPreconditionError``, as Horovod raises, and ringpipe's error."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class InvalidCallError(tf.errors.InvalidArgumentError, EngineInvalidCallError):
    """A rank's call was invalid: TensorFlow's ``InvalidArgumentError``, as Horovod raises, and ringpipe's error."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def _tf_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` raising the engine's call errors as the TensorFlow errors Horovod raises.

    Eagerly (a public op, or a collective's gradient taken by an eager tape) the caller gets
    them as they are. Inside a graph :func:`run` hands them to a ``RingpipeStatus`` node
    (:mod:`.status_op`), which fails the graph with the same type and message; any other
    exception leaves the ``tf.py_function`` node as TensorFlow maps it (mostly ``UnknownError``).
    """

    def call(*xs: Any, **kw: Any) -> Any:
        try:
            return fn(*xs, **kw)
        except (MismatchedCallError, InvalidCallError):
            raise
        except EngineMismatchError as exc:
            raise MismatchedCallError(str(exc)) from exc
        except EngineInvalidCallError as exc:
            raise InvalidCallError(str(exc)) from exc
        except NotAMemberError as exc:  # Horovod's InvalidArgument status, a TF InvalidArgumentError
            raise InvalidCallError(str(exc)) from exc

    return call


# The last collective node of each graph: the next one waits for it (see the module docstring).
_last: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


@tf.autograph.experimental.do_not_convert
def run(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    tout: Sequence[tf.DType],
    shapes: Sequence[Any],
    name: str = "ringpipe",
) -> list[tf.Tensor]:
    """``fn(*inputs)`` (eager TF tensors in, a list of TF tensors out) now, or as a graph node.

    ``tout`` and ``shapes`` describe the outputs for the graph (a shape may have ``None``
    dimensions, or be ``None`` when unknown). In a graph the outputs are read through a
    ``RingpipeStatus`` node (:mod:`.status_op`), so that ranks' mismatched or invalid calls fail
    the graph as ``FailedPreconditionError`` / ``InvalidArgumentError``, as Horovod's ops do.
    """
    fn = _tf_errors(fn)
    if tf.executing_eagerly():
        return list(fn(*inputs))
    typed = status_op.available()
    tout = list(tout)

    def body(*xs: Any) -> list[Any]:
        if not typed:
            return list(fn(*xs))
        try:
            return [*fn(*xs), tf.constant(0, tf.int64)]
        except (MismatchedCallError, InvalidCallError) as exc:  # fail the graph with its code (status_op)
            return [*(tf.zeros([0], d) for d in tout), status_op.file_error(exc)]

    graph = tf.compat.v1.get_default_graph()
    previous = _last.get(graph)
    deps = [previous] if previous is not None else []
    with tf.control_dependencies(deps):
        outs = tf.py_function(body, list(inputs), tout + ([tf.int64] if typed else []), name=name)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if outs:
        _last[graph] = outs[0].op
    if typed:
        check = status_op.status_node(outs.pop(), name)
        with tf.control_dependencies([check]):
            outs = [tf.identity(out) for out in outs]
    for out, shape in zip(outs, shapes, strict=True):
        if shape is not None:
            out.set_shape(shape)
    return outs
