"""Horovod's ``HOROVOD_*`` settings that a ringpipe rank honours, and what each becomes.

A Horovod program's environment keeps its meaning under ringpipe where ringpipe has the same
knob; a setting without one is accepted and named in a debug log, never silently half-applied.
``ringpipe launch --help`` lists this table; ``ringpipe.init()`` applies it (:func:`apply`)
before the world communicator exists, so the stall inspector and the timeline see it. This
module uses the standard library only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field

__all__ = ["SETTINGS", "HorovodSettings", "apply", "settings_help", "timeline_path", "truthy"]

log = logging.getLogger(__name__)

#: (variable, what ringpipe does with it) — the list ``ringpipe launch --help`` prints.
SETTINGS: list[tuple[str, str]] = [
    ("HOROVOD_TIMELINE=FILE", "timeline of every rank, written while the job runs (also RINGPIPE_TIMELINE); "
                              "DYNAMIC: none until hvd.start_timeline()"),
    ("HOROVOD_TIMELINE_MARK_CYCLES=1", "CYCLE_START instants where each queued operation starts"),
    ("HOROVOD_FUSION_THRESHOLD=BYTES", "DistributedOptimizer's default bucket_bytes (0: one bucket per gradient)"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE=1", "DistributedOptimizer's default algorithm becomes 'hierarchical'"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS=S", "stall warning after S seconds (RINGPIPE_STALL_CHECK_SECONDS)"),
    ("HOROVOD_STALL_CHECK_DISABLE=1", "no stall inspector (RINGPIPE_STALL_CHECK_SECONDS=0)"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=S", "a rank stalled S seconds ends (the launcher then stops the job)"),
    ("HOROVOD_LOG_LEVEL=LEVEL", "level of the 'ringpipe' logger: trace, debug, info, warning, error, fatal"),
    ("HOROVOD_DYNAMIC_PROCESS_SETS=1", "add_process_set() / remove_process_set() after init"),
    ("HOROVOD_CYCLE_TIME=MS", "accepted, no equivalent: ringpipe starts an operation as soon as it is queued"),
    ("HOROVOD_CACHE_CAPACITY=N", "accepted, no equivalent: ringpipe has no response cache, every call is checked"),
]

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "fatal": logging.CRITICAL}

_NO_EQUIVALENT = ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY")


def truthy(value: str | None) -> bool:
    """Horovod's boolean variables: set and not ``0`` / ``false`` / empty."""
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def settings_help() -> str:
    """The table of settings, one line each, for ``--help``."""
    width = max(len(k) for k, _ in SETTINGS)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in SETTINGS)


def timeline_path(env: MutableMapping[str, str]) -> str | None:
    """The timeline file asked for (``HOROVOD_TIMELINE``, else ``RINGPIPE_TIMELINE``); None: none."""
    for name in ("HOROVOD_TIMELINE", "RINGPIPE_TIMELINE"):
        value = env.get(name, "").strip()
        if value:
            return value
    return None


@dataclass
class HorovodSettings:
    """What :func:`apply` read: the parts the API applies after the communicator exists."""

    timeline: str | None = None  # a file, or None (DYNAMIC included)
    mark_cycles: bool = False
    stall_shutdown_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _seconds(env: MutableMapping[str, str], name: str) -> float:
    raw = env[name].strip()
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds; set a number (0 turns it off)") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} is negative; set a number of seconds (0 turns it off)")
    return value


def apply(env: MutableMapping[str, str] | None = None) -> HorovodSettings:
    """Apply the ``HOROVOD_*`` settings of ``env`` (default: this process's) that act before init.

    The stall settings become ``RINGPIPE_STALL_CHECK_SECONDS`` unless that is set; the log level
    sets the ``ringpipe`` logger. Bad values raise ``ValueError`` naming the variable.
    """
    env = os.environ if env is None else env
    out = HorovodSettings()
    path = timeline_path(env)
    out.timeline = None if path is None or path == "DYNAMIC" else path
    out.mark_cycles = truthy(env.get("HOROVOD_TIMELINE_MARK_CYCLES"))
    if not env.get("RINGPIPE_STALL_CHECK_SECONDS", "").strip():
        if truthy(env.get("HOROVOD_STALL_CHECK_DISABLE")):
            env["RINGPIPE_STALL_CHECK_SECONDS"] = "0"
        elif env.get("HOROVOD_STALL_CHECK_TIME_SECONDS", "").strip():
            env["RINGPIPE_STALL_CHECK_SECONDS"] = str(_seconds(env, "HOROVOD_STALL_CHECK_TIME_SECONDS"))
    if env.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "").strip():
        out.stall_shutdown_s = _seconds(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    level = env.get("HOROVOD_LOG_LEVEL", "").strip().lower()
    if level:
        if level not in _LEVELS:
            raise ValueError(f"HOROVOD_LOG_LEVEL={level!r} is not a level; use one of {', '.join(_LEVELS)}")
        logger = logging.getLogger("ringpipe")
        logger.setLevel(_LEVELS[level])
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(levelname)s] %(name)s: %(message)s"))
            logger.addHandler(handler)
    for name in _NO_EQUIVALENT:
        if env.get(name, "").strip():
            note = dict(SETTINGS)[f"{name}={'MS' if name.endswith('TIME') else 'N'}"]
            out.notes.append(f"{name}={env[name].strip()}: {note}")
            log.debug("%s=%s %s", name, env[name].strip(), note)
    return out
