"""Optimizer factories in ``load_model``'s ``custom_objects`` on Keras 3, as Keras 2 took them.

Horovod's ``load_model(path, custom_objects={"Name": lambda **kw: hvd.DistributedOptimizer(Name(**kw))})``
relies on Keras 2 calling a function found under the saved optimizer's class name with the
optimizer's config. Keras 3 only builds objects through a class's ``from_config`` and rejects a
function there. So when the ``.keras`` file's optimizer is named by a function of
``custom_objects``, that one entry becomes a class whose ``from_config(config)`` is
``factory(**config)``; every other entry (losses, activations, classes) is left as given.
"""

from __future__ import annotations

import json
import zipfile
from typing import Any

__all__ = ["is_factory", "optimizer_factories_as_classes"]


def is_factory(obj: Any) -> bool:
    """A function (not a class) that makes an object: Keras 2 calls it with the saved config."""
    return obj is not None and callable(obj) and not isinstance(obj, type)


def saved_optimizer_name(filepath: Any) -> str | None:
    """The class name of the optimizer a Keras 3 ``.keras`` file was compiled with, or None."""
    try:
        with zipfile.ZipFile(filepath) as archive:
            config = json.loads(archive.read("config.json"))
        name = config["compile_config"]["optimizer"]["class_name"]
    except (OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile):
        return None
    return name if isinstance(name, str) else None


def optimizer_factories_as_classes(filepath: Any, objects: dict[str, Any]) -> dict[str, Any]:
    """``objects`` with the saved optimizer's factory function (if any) made a class."""
    name = saved_optimizer_name(filepath)
    if name is None or not is_factory(objects.get(name)):
        return objects
    factory = objects[name]

    def from_config(cls: type, config: dict[str, Any], custom_objects: Any = None) -> Any:
        return factory(**config)

    made = type(name, (), {"from_config": classmethod(from_config), "__doc__": f"Keras 2's call of {factory!r}."})
    return {**objects, name: made}
