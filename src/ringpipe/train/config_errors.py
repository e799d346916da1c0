"""Configuration errors as the user reads them: the dotted field, the value, the valid keys or names, a did-you-mean."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from ringpipe.train.config_parallel import PIPELINE_SHORT_KEYS
from ringpipe.train.config_sections import SECTION_TAGS

__all__ = ["format_error", "did_you_mean"]


def format_error(err: ValidationError, raw: Mapping[str, Any], root: type[BaseModel]) -> str:
    """One line per problem of ``err``: the dotted field, the value, and the valid keys or names."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        # Discriminated unions put the variant tag in the location (model.mlp.hidden): drop it.
        clean = [p for i, p in enumerate(loc) if not (i > 0 and (p in SECTION_TAGS or _is_tag(raw, loc[:i], p)))]
        field = ".".join(clean) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(raw, clean[:-1], root)
            hint = f"; valid keys here: {', '.join(valid)}" if valid else ""
            near = did_you_mean(clean[-1], valid) or (_in_a_section(clean[0], root) if len(clean) == 1 else "")
            lines.append(f"{field}: unknown key (value {e['input']!r}){near}{hint}")
        elif e["type"] == "union_tag_invalid":
            ctx = e.get("ctx", {})
            tag, expected = str(ctx.get("tag")), str(ctx.get("expected_tags", ""))
            names = [n.strip(" '\"") for n in expected.split(",")]
            lines.append(f"{field}.name={tag!r}: unknown name{did_you_mean(tag, names)}; valid names: {expected}")
        elif e["type"] == "missing":
            lines.append(f"{field}: required field is missing")
        elif field == "<root>":
            lines.append(msg)
        elif e["type"] == "value_error":
            lines.append(f"{field}: {msg}")
        else:
            lines.append(f"{field}={e['input']!r}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'epochs'?)"`` for the closest of ``choices``, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _in_a_section(key: str, root: type[BaseModel]) -> str:
    """``" (did you mean 'pipeline.microbatches'?)"`` for a top-level ``key`` that is a key of one of ``root``'s
    sections (a section with one model, such as ``pipeline`` or ``checkpoint``), or "" when none has it."""
    homes = [f"{name}.{key}" for name, f in root.model_fields.items()
             if any(isinstance(t, type) and issubclass(t, BaseModel) and key in t.model_fields
                    for t in (f.annotation, *typing.get_args(f.annotation)))]
    return f" (did you mean {' or '.join(repr(h) for h in homes)}?)" if homes else ""


def _is_tag(raw: Mapping[str, Any], path: Sequence[str], part: str) -> bool:
    node: Any = raw
    for p in path:
        if not isinstance(node, Mapping) or p not in node:
            return False
        node = node[p]
    return isinstance(node, Mapping) and node.get("name") == part and part not in node


def _valid_keys(raw: Mapping[str, Any], path: Sequence[str], root: type[BaseModel]) -> list[str]:
    """The field names of the section at ``path`` (for the section variant chosen by ``name``)."""
    model: Any = root
    node: Any = raw
    for p in path:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or p not in model.model_fields:
            return []
        node = node.get(p, {}) if isinstance(node, Mapping) else {}
        model = _resolve(model.model_fields[p].annotation, node)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields) + (list(PIPELINE_SHORT_KEYS) if not path else [])
    return []


def _resolve(annotation: Any, node: Any) -> Any:
    """The concrete section class behind ``annotation`` for the raw value ``node``."""
    candidates = [a for a in _flatten_union(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(candidates) == 1:
        return candidates[0]
    name = node.get("name") if isinstance(node, Mapping) else None
    for c in candidates:
        field = c.model_fields.get("name")
        if field is not None and name in getattr(field.annotation, "__args__", ()):
            return c
    return candidates[0] if candidates else None


def _flatten_union(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    meta = getattr(annotation, "__metadata__", None)
    if meta is not None:  # Annotated[X, ...]
        return _flatten_union(annotation.__origin__)
    if args:
        out: list[Any] = []
        for a in args:
            out.extend(_flatten_union(a))
        return out
    return [annotation]
