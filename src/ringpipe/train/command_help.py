"""The ``--help`` text of ``ringpipe train``: every config key, mode and mitigation, built only when shown."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import textwrap
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from ringpipe.train.config import (
    ASYNC_KEYS,
    MODE_NAMES,
    DPConfig,
    PipelineConfig,
    TrainConfig,
    bundled_configs,
    dp_algorithms,
    mitigations_help,
)

__all__ = ["epilog_when_shown"]

_EPILOG = """\
configuration:
  Every setting lives in a typed config (YAML or JSON); the defaults are the default run:
  an MLP on the embedded 8x8 digits, mode dp on 2 local processes, Adam, cosine schedule
  with 2 warmup epochs. Keys (sections are chosen by their `name`):
{keys}
  batch_size is per data-parallel replica; epochs are counted as samples seen / records.
  optimizer.lr is the rate of one process: with optimizer.scale_lr (default true) it is multiplied
  by the number of data-parallel replicas (the rate logged), and warmup starts from the unscaled rate.
  dp.backward_passes_per_step and pipeline.microbatches split each step's batch; a step is one batch.

modes:
{modes}

{mitigations}

run directory: one run each: a new run needs a new or empty --run-dir (--resume continues the run in it,
  --overwrite replaces it); default runs/<date>-<time>-<mode>-<random>.
  config.yaml (resolved), metrics.jsonl, checkpoints/ (checksummed), curves.png, summary.json;
  with several processes also comm_profile.txt, doctor.txt and events.json (observe.profile: read by
  `ringpipe doctor RUN` and `ringpipe trace RUN`), timeline.json (observe.timeline: a Chrome trace of
  every rank's communication)

Ctrl-C stops at the next log window (every step on one process): checkpoint, evaluation, summary
  (stop_reason: interrupt), exit code 130; continue with --resume. A second Ctrl-C stops at once.
  Modes single, ddp and dp resume on any number of processes (--resume --nprocs N) and in any of
  the three: step and samples seen kept, the interrupted pass's unseen samples dealt to the new
  ranks, the rate rescaled (scale_lr); pipeline modes resume on the world that wrote them.

examples:
  ringpipe train
  ringpipe train --config ddp --set optimizer.lr=0.003 --set epochs=10   (bundled examples: {bundled})
  ringpipe train --mode single --set model.name=cnn --run-dir runs/cnn
  ringpipe train --run-dir runs/cnn --resume --set max_steps=null
  ringpipe train --config async --set mitigations=wp,ws --set step_every=2
  torchrun --nproc-per-node 4 -m ringpipe.cli train --config ddp
  ringpipe data fetch mnist && ringpipe train --config mnist
  mpirun -n 2 python -m ringpipe.cli train --mode dp
"""

_WIDTH = 100


def _choices(annotation: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` field (also inside ``X | None``), else ()."""
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(annotation))
    return tuple(c for a in typing.get_args(annotation) for c in _choices(a))


def _fields_help(model: type[BaseModel], skip: Sequence[str] = (),
                 choices: dict[str, Sequence[str]] | None = None) -> str:
    """``key, key (a | b), ...`` for the fields of one section, with the values of enumerated ones."""
    out = []
    for name, field in model.model_fields.items():
        values = (choices or {}).get(name) or _choices(field.annotation)
        if name not in skip:
            out.append(f"{name} ({' | '.join(values)})" if values else name)
    return ", ".join(out)


def _variants_help(section: str) -> str:
    """``name(key, ...) | ...`` for a section whose variant is chosen by ``name``, from the schema."""
    every = _variants(TrainConfig.model_fields[section].annotation)
    variants = [v for v in every if v.model_config.get("extra") != "allow"]
    user = len(variants) < len(every)
    fields = [[f for f in v.model_fields if f != "name"] for v in variants]
    common = [f for f in fields[0] if all(f in fs for fs in fields)] if len(fields) > 1 else []
    parts = []
    for variant, names in zip(variants, fields, strict=True):
        tags = ", ".join(_choices(variant.model_fields["name"].annotation))
        own = [f for f in names if f not in common]
        parts.append(f"{tags}({', '.join(own)})" if own else tags)
    return (" | ".join(parts) + (f"; all take {', '.join(common)}" if common else "")
            + (" | package.module:function or a registered name (other keys: the factory's arguments)"
               if user else ""))


def _variants(annotation: Any) -> list[Any]:
    """The section classes of a union (``Annotated[X, Tag]`` members unwrapped)."""
    out = []
    for a in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(a) is typing.Annotated:
            a = typing.get_args(a)[0]
        if isinstance(a, type) and issubclass(a, BaseModel):
            out.append(a)
    return out


def _keys_help() -> str:
    """Every key of the schema, one line (wrapped) per section."""
    sections = [n for n, f in TrainConfig.model_fields.items() if _is_section(f.annotation)]
    rows = [("", _fields_help(TrainConfig, skip=sections))]
    for name in sections:
        if name in ("pipeline", "dp"):
            continue
        model = TrainConfig.model_fields[name].annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            rows.append((f"{name}: ", _fields_help(model)))
        else:
            rows.append((f"{name}.name: ", _variants_help(name)))
    rows.append(("pipeline (pipeline modes): ", _fields_help(PipelineConfig, skip=(*ASYNC_KEYS, "chunks"))
                 + "; mode interleaved also: chunks (model chunks per rank, default 2)"
                 + f"; mode async also: {', '.join(ASYNC_KEYS)} (below)"))
    rows.append(("dp (mode dp): ", _fields_help(DPConfig, choices={"algorithm": dp_algorithms()})))
    lines = []
    for head, body in rows:
        lines.append(textwrap.fill(body, _WIDTH, initial_indent="    " + head,
                                   subsequent_indent=" " * (4 + len(head)), break_on_hyphens=False))
    return "\n".join(lines)


def _is_section(annotation: Any) -> bool:
    return bool(_variants(annotation))


def _modes_help() -> str:
    """One line per mode, from the mode registry."""
    from ringpipe.train.modes import MODES

    with contextlib.suppress(ImportError):  # pipeline modes register on import
        importlib.import_module("ringpipe.train.pipeline_modes")
    width = max(len(m) for m in MODE_NAMES)
    lines = []
    for mode in MODE_NAMES:
        text = MODES.get(mode).description if mode in MODES else "not available in this build"
        lines.append(textwrap.fill(text, _WIDTH, initial_indent=f"  {mode:<{width}}  ",
                                   subsequent_indent=" " * (width + 4), break_on_hyphens=False))
    return "\n".join(lines)


def _epilog() -> str:
    return _EPILOG.format(keys=_keys_help(), modes=_modes_help(), mitigations=mitigations_help(_WIDTH),
                          bundled=", ".join(bundled_configs()))


def _epilog_when_shown(parser: argparse.ArgumentParser) -> None:
    """Build the epilog (which imports the mode registry, and with it torch) only when help is printed."""
    plain = parser.format_help

    def format_help() -> str:
        if parser.epilog is None:
            parser.epilog = _epilog()
        return plain()

    parser.format_help = format_help  # type: ignore[method-assign]


epilog_when_shown = _epilog_when_shown
