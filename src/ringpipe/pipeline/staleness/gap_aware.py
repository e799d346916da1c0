"""Gap Aware: scale a stale gradient down by ``1 + Gap / C`` elementwise.

Barkai, Hakimi and Schuster, "Gap-Aware Mitigation of Gradient Staleness", ICLR 2020; the
statistics follow ALGORITHMS.md §1. ``Gap`` is how far the weights moved between the ones the
gradient was computed on and the ones the optimizer is about to update; ``C`` is the typical
size of one step, tracked after every step:

- SGD, PyTorch form: ``ra <- gamma_b ra + (1-gamma_b) v^2`` (``v`` the momentum buffer, or the
  gradient without momentum), ``C = eta_max (sqrt(ra / (1 - gamma_b^steps)) + eps)``,
  ``eta_max`` the largest learning rate seen so far.
- SGD, Sutskever form (:class:`~ringpipe.pipeline.staleness.sutskever.SutskeverSGD`): the
  velocity ``v <- gamma v + eta g`` already holds the learning rate (the step is ``v`` itself),
  so ``C = sqrt(ra / (1 - gamma_b^steps)) + eta_max eps``, with the same ``ra`` of ``v^2``:
  for a constant rate this is exactly the PyTorch-form ``C`` (``v_sutskever = eta v_pytorch``).
- Adam / AdamW: ``e <- beta2 e + (1-beta2) (eta/(1-beta1^t) m/denom)^2``, ``C = sqrt(e) + eps``,
  with ``eta`` the learning rate *the step used* (recorded by :meth:`GapAware.record_step`
  before ``optimizer.step()``; an LR scheduler changes the group's rate right after it).

Parameter groups whose largest learning rate so far is ``<= 0`` never move, so there is no gap
to penalise and ``C`` would be 0: their gradients are left untouched (penalty 1).

``Gap`` is measured when the weights the gradient used are stashed (``apply_on_stashed``,
``apply_on_theta``, ``apply_gap``). Without a stash (``ga`` without ``ws``, SGD only) those
weights are not kept, and :meth:`GapAware.apply_from_grad` uses ``Gap = eta |g|``, the step
the gradient itself causes: the gap of a gradient of staleness 1 (the only staleness at which
the reference implementation allows it). Deeper staleness needs a stash;
:func:`~ringpipe.pipeline.staleness.make_policy` refuses Gap Aware without one on a stage whose
staleness can reach 2.

The gradient becomes ``g / penalty``; with L2 weight decay (SGD, Adam) ``theta lambda
(1-penalty)/penalty`` is added so that the optimizer's own ``+lambda theta`` term is divided
by the penalty as well. AdamW's decoupled decay is not a gradient term and is left alone.
Before the first statistics update ``C`` is undefined and nothing is scaled (``ready``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch

from ringpipe.pipeline.staleness.optimizer_kind import optimizer_kind, param_groups_of

__all__ = [
    "GapAware",
    "SGDGapAware",
    "AdamGapAware",
    "gap_aware_for",
    "gap_aware_stages",
    "GA_STAGE_POLICIES",
]

GA_STAGE_POLICIES = ("almost_last_partition", "all_except_last", "all_except_last_two")


def gap_aware_stages(policy: str, num_stages: int) -> frozenset[int]:
    """The stages a gap-aware stage policy applies to (stage ``i`` has depth ``N-1-i``)."""
    if policy == "almost_last_partition":
        return frozenset({num_stages - 2}) if num_stages >= 2 else frozenset()
    if policy == "all_except_last":
        return frozenset(range(num_stages - 1))
    if policy == "all_except_last_two":
        return frozenset(range(num_stages - 2))
    raise ValueError(
        f"unknown gap-aware stage policy {policy!r}; valid: {', '.join(GA_STAGE_POLICIES)}"
    )


class GapAware(ABC):
    """Shared machinery: penalties from gaps and the gradient division; subclasses track ``C``."""

    def __init__(
        self,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        eps: float = 1e-8,
    ) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.kind = optimizer_kind(optimizer)
        self.eps = eps
        self._groups = param_groups_of(self.params, optimizer)
        self.updates = 0
        self.eta_max = [float(g["lr"]) for g in self._groups]
        self._step_lrs: list[float] | None = None

    @property
    def ready(self) -> bool:
        """Whether ``C`` is defined (the statistics were updated after at least one step)."""
        return self.updates > 0

    @abstractmethod
    def constants(self) -> list[torch.Tensor]:
        """``C`` per parameter."""

    @abstractmethod
    def update_running_stats(self) -> None:
        """Fold the step just taken into the statistics; call right after ``optimizer.step()``."""

    def state_dict(self) -> dict[str, Any]:
        """The statistics that shape every later penalty (for checkpoints): copies."""
        return {
            "updates": self.updates,
            "running": [t.detach().clone() for t in getattr(self, "running", [])],
            "eta_max": list(self.eta_max),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the same parameters, in the same order)."""
        running = getattr(self, "running", [])
        if len(state["running"]) != len(running) or len(state["eta_max"]) != len(self.eta_max):
            raise ValueError(
                f"Gap Aware state for {len(state['running'])} parameters, this stage has {len(running)}; "
                "load the checkpoint of the same model and pipeline split"
            )
        for mine, saved in zip(running, state["running"], strict=True):
            mine.copy_(saved)
        self.updates = int(state["updates"])
        self.eta_max = [float(e) for e in state["eta_max"]]

    def record_step(self) -> None:
        """Remember each parameter's learning rate for the step about to be taken.

        Call right before ``optimizer.step()``: :meth:`update_running_stats` runs after the LR
        scheduler has already set the next step's rate.
        """
        self._step_lrs = [float(g["lr"]) for g in self._groups]

    def _lrs_of_step(self) -> list[float]:
        lrs = self._step_lrs if self._step_lrs is not None else [float(g["lr"]) for g in self._groups]
        self._step_lrs = None
        return lrs

    def _track_eta_max(self) -> None:
        self.eta_max = [max(e, float(g["lr"])) for e, g in zip(self.eta_max, self._groups, strict=True)]

    def moving(self, i: int) -> bool:
        """Whether parameter ``i``'s group has had a positive learning rate (else: never penalised)."""
        return self.eta_max[i] > 0.0

    @torch.no_grad()
    def penalties(self, gaps: list[torch.Tensor]) -> list[torch.Tensor]:
        """``1 + Gap / C`` per parameter (ones for groups whose largest learning rate is <= 0)."""
        return [
            1.0 + gap / c if self.moving(i) else torch.ones_like(gap)
            for i, (gap, c) in enumerate(zip(gaps, self.constants(), strict=True))
        ]

    @torch.no_grad()
    def apply_penalty(
        self, penalties: list[torch.Tensor], decay_on: list[torch.Tensor] | None = None
    ) -> None:
        """``g <- g / penalty`` plus the weight-decay correction for L2 decay.

        The optimizer adds ``lambda theta`` of the weights it steps on, the true ones:
        ``decay_on`` names them when the parameters hold other weights (a loaded stash).
        """
        weights = decay_on if decay_on is not None else [p.detach() for p in self.params]
        for i, (p, group, pen) in enumerate(zip(self.params, self._groups, penalties, strict=True)):
            if p.grad is None or not self.moving(i):
                continue
            p.grad.div_(pen)
            lam = float(group.get("weight_decay", 0.0))
            if lam != 0.0 and self.kind != "adamw":
                p.grad.add_(weights[i] * lam * (1.0 - pen) / pen)

    def apply_gap(
        self, gaps: list[torch.Tensor], decay_on: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Scale the gradients by the penalties of ``gaps``; returns the penalties (no-op if not ready)."""
        if not self.ready:
            return []
        pens = self.penalties(gaps)
        self.apply_penalty(pens, decay_on)
        return pens

    @torch.no_grad()
    def apply_on_theta(self, real_theta: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters hold the weights the gradient used; ``real_theta`` the current ones.

        The weight-decay correction uses ``real_theta``: those are the weights the optimizer
        will decay once they are put back.
        """
        real = [r.detach() for r in real_theta]
        return self.apply_gap([(r - p).abs() for r, p in zip(real, self.params, strict=True)], real)

    @torch.no_grad()
    def apply_on_stashed(self, stashed: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters hold the current weights; ``stashed`` the ones the gradient used."""
        return self.apply_gap([(p - s).abs() for p, s in zip(self.params, stashed, strict=True)])

    def apply_from_grad(self) -> list[torch.Tensor]:
        """Gap estimated from the gradient alone, ``Gap = eta |g|``; SGD only, staleness 1 only.

        The weights the gradient was computed on are not kept, so the gap cannot be measured;
        ``eta |g|`` is the step the gradient itself causes, the gap of staleness 1.
        """
        raise ValueError(
            f"gap aware from the gradient is defined for SGD only, not {self.kind}; "
            "stash the weights ('ws+ga') so the gap is measured"
        )


class SGDGapAware(GapAware):
    """Gap Aware for SGD (both momentum forms): ``C`` from the running mean of ``v^2``.

    PyTorch form: ``C = eta_max (rms(v) + eps)``. Sutskever form, whose velocity already
    includes the learning rate: ``C = rms(v) + eta_max eps``.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        big_gamma: float = 0.999,
        eps: float = 1e-8,
    ) -> None:
        super().__init__(params, optimizer, eps=eps)
        self.big_gamma = big_gamma
        self.running = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    @torch.no_grad()
    def constants(self) -> list[torch.Tensor]:
        correction = 1.0 - self.big_gamma**self.updates
        if self.kind == "sutskever":  # the velocity is the step: no second factor of the rate
            return [
                (ra / correction).sqrt() + eta * self.eps
                for ra, eta in zip(self.running, self.eta_max, strict=True)
            ]
        return [
            eta * ((ra / correction).sqrt() + self.eps)
            for ra, eta in zip(self.running, self.eta_max, strict=True)
        ]

    @torch.no_grad()
    def update_running_stats(self) -> None:
        gb = self.big_gamma
        self._step_lrs = None
        for i, p in enumerate(self.params):
            v = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if v is None:
                v = p.grad if p.grad is not None else torch.zeros_like(p)
            self.running[i].mul_(gb).addcmul_(v, v, value=1.0 - gb)
        self._track_eta_max()  # the rate of the next step included, as the scheduler just set it
        self.updates += 1

    @torch.no_grad()
    def apply_from_grad(self) -> list[torch.Tensor]:
        """``Gap = eta |g|`` (the step the gradient itself would cause), per parameter group's ``eta``.

        The gap of a gradient of staleness 1 (without a stash the weights the gradient used are
        not kept); ``g`` is the accumulated ``p.grad`` of the step.
        """
        gaps = [
            float(g["lr"]) * (p.grad.abs() if p.grad is not None else torch.zeros_like(p))
            for p, g in zip(self.params, self._groups, strict=True)
        ]
        return self.apply_gap(gaps)


class AdamGapAware(GapAware):
    """Gap Aware for Adam and AdamW: ``C`` from the running mean of the squared Adam step."""

    def __init__(
        self,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        eps: float = 1e-8,
    ) -> None:
        super().__init__(params, optimizer, eps=eps)
        self.running = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    @torch.no_grad()
    def constants(self) -> list[torch.Tensor]:
        return [e.sqrt() + self.eps for e in self.running]

    @torch.no_grad()
    def update_running_stats(self) -> None:
        lrs = self._lrs_of_step()
        for i, (p, group) in enumerate(zip(self.params, self._groups, strict=True)):
            state = self.optimizer.state.get(p, {})
            if "exp_avg" not in state:
                continue
            beta1, beta2 = (float(b) for b in group["betas"])
            t = int(state["step"])
            u = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
            step_size = lrs[i] / (1.0 - beta1**t)
            denom = u.sqrt() / math.sqrt(1.0 - beta2**t) + float(group["eps"])
            step = state["exp_avg"] * step_size / denom
            self.running[i].mul_(beta2).addcmul_(step, step, value=1.0 - beta2)
        self._track_eta_max()
        self.updates += 1


def gap_aware_for(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, **kwargs: Any
) -> GapAware:
    """The Gap Aware variant matching ``optimizer`` (SGD forms, Adam, AdamW)."""
    kind = optimizer_kind(optimizer)
    if kind in ("sgd", "sutskever"):
        return SGDGapAware(params, optimizer, **kwargs)
    kwargs.pop("big_gamma", None)
    return AdamGapAware(params, optimizer, **kwargs)
