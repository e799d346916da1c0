"""``--set key=value`` overrides of a raw trainer configuration, applied before validation.

The value is read as YAML (numbers, bools, lists, null); a dotted key walks into sections; a
top-level pipeline short key (``step_every``, ``recompute``, ...) means the ``pipeline``
section's key. :mod:`ringpipe.train.config` re-exports both functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from ringpipe.train.config_parallel import PIPELINE_SHORT_KEYS
from ringpipe.train.config_sections import ConfigError, variant_fields

__all__ = ["apply_overrides", "parse_override"]


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as YAML (numbers, bools, lists, null)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected key=value with a dotted key, e.g. --set optimizer.lr=0.1")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str],
                    given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Apply ``--set key=value`` items to a raw config dict (a copy is returned).

    Setting ``section.name`` to another variant starts the section afresh from that variant's defaults
    (so ``--set model.name=cnn`` works on an MLP config), keeping the section's keys that this
    command's other ``--set`` items give, whatever their order (``--set optimizer.lr=0.01 --set
    optimizer.name=sgd`` is ``--set optimizer.name=sgd --set optimizer.lr=0.01``), and those that the
    user's config (``given``: the file's and the caller's keys, defaults left out) gives and the new
    variant reads (a file's ``optimizer.lr`` stays when ``--set optimizer.name=sgd`` switches
    to SGD; Adam's ``betas`` go). A top-level pipeline short key (``--set step_every=2``) sets
    ``pipeline.step_every``.
    """
    out = json.loads(json.dumps(raw, default=str))
    earlier_sets: dict[str, list[tuple[list[str], Any, str]]] = {}  # a section's items so far, but its name
    for item in overrides:
        path, value = parse_override(item)
        if len(path) == 1 and path[0] in PIPELINE_SHORT_KEYS:
            path = ["pipeline", path[0]]  # the short form of a pipeline key
        if len(path) == 2 and path[1] == "name" and isinstance(out.get(path[0]), dict) \
                and out[path[0]].get("name") not in (None, value):
            fields = variant_fields(path[0], value)
            mine = (given or {}).get(path[0])
            out[path[0]] = {k: v for k, v in mine.items() if k != "name" and k in fields} \
                if fields is not None and isinstance(mine, Mapping) else {}
            for earlier, v, text in earlier_sets.get(path[0], []):
                _put(out, earlier, v, text)
        _put(out, path, value, item)
        if len(path) >= 2 and path[1:] != ["name"]:
            earlier_sets.setdefault(path[0], []).append((path, value, item))
    return out


def _put(out: dict[str, Any], path: list[str], value: Any, item: str) -> None:
    """Set ``value`` at the dotted ``path`` of ``out``, making the sections on the way."""
    node = out
    for p in path[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {p!r} is a value ({child!r}), not a section")
        node = child
    node[path[-1]] = value
