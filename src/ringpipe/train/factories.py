"""The user's factories named in a config (``package.module:function``): imported and called, with clear errors.

A model section ``{name: my_package.nets:make_net, width: 64}`` calls ``make_net(width=64)``,
adding ``data=`` (the loaded :class:`~ringpipe.train.datasets.Dataset`) when the function has a
parameter of that name; a data section calls its function with its keys alike. The module is
looked up on ``sys.path`` with the current directory first, as ``python -m`` does, so that a
``mymodels.py`` beside the command is found by ``mymodels:factory`` on every rank. An import that
fails, a missing attribute, a call that raises or a result of the wrong kind is reported with
the section, the path and what to fix, on every rank alike.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["FactoryError", "import_factory", "call_factory", "section_kwargs", "takes_parameter"]


class FactoryError(ValueError):
    """A user factory named in a config could not be imported or called, or returned the wrong kind of object."""


def import_factory(path: str, section: str) -> Callable[..., Any]:
    """The callable at ``package.module:function`` (the function may be a dotted attribute path)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise FactoryError(f"{section}.name={path!r}: write the factory as package.module:function")
    _current_directory_importable()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(
            f"{section}.name={path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}) from the "
            f"current directory {os.getcwd()} or sys.path; run from the folder that holds it, put its package on "
            f"PYTHONPATH (every rank's), install it, or fix the name"
        ) from exc
    except Exception as exc:
        raise FactoryError(
            f"{section}.name={path!r}: importing module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            hint = f"; its callables: {', '.join(public[:20])}" if public else ""
            raise FactoryError(f"{section}.name={path!r}: {module_name!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"{section}.name={path!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def _current_directory_importable() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does (a console script
    such as ``ringpipe`` has its own folder there instead)."""
    cwd = os.getcwd()
    if not any(entry in ("", ".") or os.path.abspath(entry) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()


def takes_parameter(factory: Callable[..., Any], name: str) -> bool:
    """Whether ``factory`` has a parameter called ``name`` (False where it has no signature)."""
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def section_kwargs(section: Any) -> dict[str, Any]:
    """The keys of a user section besides ``name``: the factory's keyword arguments."""
    extra = getattr(section, "model_extra", None) or {}
    return dict(extra)


def call_factory(factory: Callable[..., Any], kwargs: dict[str, Any], path: str, section: str,
                 data: Any = None) -> Any:
    """Call ``factory(**kwargs)`` (plus ``data=`` where it takes it); errors name the section and the keys."""
    kwargs = dict(kwargs)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it as given
        params = {}  # type: ignore[assignment]
    if data is not None and "data" in params and "data" not in kwargs:
        kwargs["data"] = data
    try:
        return factory(**kwargs)
    except TypeError as exc:
        given = ", ".join(f"{section}.{k}" for k in kwargs if k != "data") or "no keys"
        raise FactoryError(
            f"{section}.name={path!r}: calling it with {given} failed: {exc}; the section's keys besides "
            f"name are passed as keyword arguments"
        ) from exc
    except Exception as exc:
        raise FactoryError(f"{section}.name={path!r} raised {type(exc).__name__}: {exc}") from exc
