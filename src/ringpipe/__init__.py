"""ringpipe: distributed deep-learning training on PyTorch.

``import ringpipe as hvd`` gives the Horovod-style API (``init``, ``rank``, ``allreduce``,
``DistributedOptimizer``, ...); the communicator layer, the launcher, the pipeline engine and
the trainer live in the subpackages.

The top-level names are imported on first use (PEP 562), so that the command line
(``ringpipe --help``, ``ringpipe train --help``) starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers see them; at run time __getattr__ imports them
    from ringpipe.api import *  # noqa: F403
    from ringpipe.comm import CommError as CommError
    from ringpipe.comm import Communicator as Communicator
    from ringpipe.comm import ReduceOp as ReduceOp
    from ringpipe.comm import comm_stats as comm_stats
    from ringpipe.comm import init_world as init_world
    from ringpipe.comm import shutdown_world as shutdown_world
    from ringpipe.env import Topology as Topology
    from ringpipe.env import detect as detect
    from ringpipe.launch import local_rank_zero_first as local_rank_zero_first
    from ringpipe.launch import spawn as spawn
    from ringpipe.launch.run_api import run as run
    from ringpipe.pipeline import PipelineTrainer as PipelineTrainer

from ringpipe import quick_exit as _quick_exit
from ringpipe.version import __version__ as __version__

_quick_exit.install()  # only with RINGPIPE_QUICK_EXIT=1 (see ringpipe/quick_exit.py)

#: names that are not the Horovod-style API's, and the module each comes from
_HOME = {
    "CommError": "ringpipe.comm",
    "Communicator": "ringpipe.comm",
    "ReduceOp": "ringpipe.comm",
    "comm_stats": "ringpipe.comm",
    "init_world": "ringpipe.comm",
    "shutdown_world": "ringpipe.comm",
    "Topology": "ringpipe.env",
    "detect": "ringpipe.env",
    "local_rank_zero_first": "ringpipe.launch",
    "spawn": "ringpipe.launch",
    "run": "ringpipe.launch.run_api",
    "PipelineTrainer": "ringpipe.pipeline",
}


def _all() -> list[str]:
    from ringpipe.api import __all__ as api_all

    return [*api_all, *sorted(_HOME)]


def __getattr__(name: str) -> Any:
    if name == "__all__":  # `from ringpipe import *`
        value: Any = _all()
    elif name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    elif name.startswith("__"):
        raise AttributeError(f"module 'ringpipe' has no attribute {name!r}")
    else:
        api = importlib.import_module("ringpipe.api")
        if hasattr(api, name):
            value = getattr(api, name)
        else:
            try:  # a subpackage not imported yet: ringpipe.collectives, ...
                value = importlib.import_module(f"ringpipe.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"ringpipe.{name}":
                    raise
                raise AttributeError(f"module 'ringpipe' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_all()})
