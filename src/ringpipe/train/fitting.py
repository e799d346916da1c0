"""``ringpipe.train.fit``: the loop of ``ringpipe train`` on the user's own model, data, loss and optimizer.

Every rank of the job calls :func:`fit` with the same arguments; the world is whatever started
the script (``ringpipe launch``, torchrun, mpirun, srun; one process when started plainly), and
the config chooses the mode (``single``, ``dp``, ``ddp``, ``seq``, ``gpipe``, ``1f1b``, ``async``),
precision, clipping, accumulation, schedule, checkpoints and outputs exactly as for
``ringpipe train``::

    import torch, ringpipe.train as rt

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    summary = rt.fit(net, train_set, test_set,
                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                     config={"mode": "gpipe", "epochs": 3, "batch_size": 32, "pipeline": {"stages": 2}})

``model``: an ``nn.Module`` (an ``nn.Sequential``, or a list of modules, for the pipeline modes
which cut it between entries), or a function returning one, called on every rank after seeding
with ``config.seed``. A module is made equal on every rank (rank 0's parameters and buffers are
broadcast) and is trained in place: after :func:`fit` the data-parallel modes leave the trained
model in it, the pipeline modes each rank's stage of it. ``train_data`` / ``test_data``: map-style
torch Datasets of ``(input, target)`` pairs (see :mod:`ringpipe.train.userdata`). ``loss``:
``(output, target) -> mean loss`` (default cross-entropy). ``optimizer``: ``params -> Optimizer``
(default the config's optimizer section, with its rate scaled by the replicas; the factory's
rate is used as given). Either of ``model`` and ``train_data`` may be None: the config's
``model`` / ``data`` section then names it (a built-in, registered or ``package.module:function``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringpipe.comm import Communicator
from ringpipe.train.config import TrainConfig, load_config
from ringpipe.train.config_sections import FROM_PYTHON, UserDataConfig, UserModelConfig
from ringpipe.train.loop import Given, train
from ringpipe.train.userdata import as_dataset

__all__ = ["fit"]


def _config(config: TrainConfig | Mapping[str, Any] | str | Path | None, world: int) -> TrainConfig:
    if isinstance(config, TrainConfig):
        return config
    if config is None:
        return load_config(base={"mode": "single" if world == 1 else "dp"})
    if isinstance(config, Mapping):
        return load_config(base=config)
    return load_config(config)


def _sync(model: nn.Module, comm: Communicator) -> None:
    """Rank 0's parameters and buffers on every rank (a model built without a shared seed starts equal)."""
    if comm.size == 1:
        return
    with torch.no_grad():
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and t.numel():
                buf = t.detach().contiguous()
                device = getattr(comm, "device", None)
                moved = buf.to(device) if isinstance(device, torch.device) else buf
                comm.broadcast(moved, 0)
                if moved is not t:
                    t.copy_(moved)


def _model_source(model: Any, comm: Communicator) -> tuple[Callable[[], nn.Module], str]:
    if isinstance(model, nn.Module):
        _sync(model, comm)
        return (lambda: model), type(model).__name__
    if isinstance(model, list | tuple):
        if not model or not all(isinstance(m, nn.Module) for m in model):
            raise TypeError("fit(model=[...]): a list of stages must hold nn.Modules only")
        seq = nn.Sequential(*model)
        _sync(seq, comm)
        return (lambda: seq), "list"
    if callable(model):
        def build() -> nn.Module:
            built = model()
            if isinstance(built, list | tuple):
                built = nn.Sequential(*built)
            if not isinstance(built, nn.Module):
                raise TypeError(f"fit(model=...): the model function returned a {type(built).__name__}, not an nn.Module")
            return built

        return build, getattr(model, "__name__", type(model).__name__)
    raise TypeError(
        f"fit(model=...) got a {type(model).__name__}; give an nn.Module (nn.Sequential or a list of modules for "
        f"the pipeline modes), a function returning one, or None to build the config's model section"
    )


def fit(
    model: nn.Module | list[nn.Module] | Callable[[], nn.Module] | None,
    train_data: Any,
    test_data: Any = None,
    *,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    config: TrainConfig | Mapping[str, Any] | str | Path | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    comm: Communicator | None = None,
) -> dict[str, Any]:
    """Train on this rank of the job; returns the run's summary (the same dict on every rank).

    ``config``: a :class:`TrainConfig`, a dict of keys as in a config file, a file path or a
    bundled config's name (default: mode ``single`` on one process, ``dp`` on more). ``run_dir``:
    where rank 0 writes the run (default ``runs/<mode>-<time>``). ``comm``: a communicator to run
    on (default: the launcher's world, set up here and shut down on return).
    """
    own = comm is None
    if comm is None:
        from ringpipe.comm import init_world

        probe = _config(config, 1) if config is not None else None
        comm = init_world(probe.backend if probe is not None else "gloo")
    try:
        cfg = _config(config, comm.size)
        given = Given(loss=loss, optimizer=optimizer)
        update: dict[str, Any] = {}
        if model is not None:
            given.model, label = _model_source(model, comm)
            update["model"] = UserModelConfig(name=FROM_PYTHON, **{"class": label})
        if train_data is not None:
            given.data = as_dataset(train_data, FROM_PYTHON, "fit()", test=test_data)
            update["data"] = UserDataConfig(name=FROM_PYTHON, **{"class": type(train_data).__name__})
        elif test_data is not None:
            raise ValueError("fit(test_data=...) without train_data: give both, or neither (the config's data)")
        cfg = cfg.model_copy(update=update)
        return train(comm, cfg, _run_dir(comm, cfg, run_dir, resume, overwrite), resume=resume, progress=progress,
                     overwrite=overwrite, given=given)
    finally:
        if own:
            from ringpipe.comm import shutdown_world

            shutdown_world()


def _run_dir(comm: Communicator, cfg: TrainConfig, run_dir: str | Path | None, resume: bool, overwrite: bool) -> Path:
    """Rank 0 names the run directory (refusing an earlier run's without ``resume`` or ``overwrite``); every rank uses it."""
    from ringpipe.train.command import resolve_run_dir
    from ringpipe.train.rundir import run_dir_problem

    found: tuple[str, str] | None = None
    if comm.rank == 0:
        path = resolve_run_dir(str(run_dir) if run_dir is not None else None, cfg.mode, resume)
        found = (str(path), run_dir_problem(path, resume, overwrite) if run_dir is not None else "")
    name, problem = comm.broadcast_object(found) if comm.size > 1 else found  # type: ignore[misc]
    if problem:
        raise ValueError(problem)
    return Path(name)
