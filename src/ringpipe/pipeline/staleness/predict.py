"""Weight prediction ("msnag"): the weights a stage will hold ``d`` optimizer steps ahead.

Before a stale forward the stage's parameters are replaced (in place) by a prediction of the
weights ``d`` steps ahead, assuming future gradients are zero; the true weights are kept aside
and restored after the forward. Formulas (ALGORITHMS.md §1, after SpecTrain, Chen et al. 2018,
and FTPipe, Eliad et al. 2021), with ``eta_k`` the learning rate of future step ``k``:

- SGD, PyTorch form: ``theta - sum_k eta_k gamma^k v``; with a constant rate that is
  ``theta - eta c_d v``, ``c_d = (gamma - gamma^(d+1)) / (1 - gamma)``. Nesterov adds one
  factor ``gamma``. With weight decay (or ``aggmsnag``) the SGD recursion is iterated ``d``
  times with gradient ``lambda*theta_hat`` (plus the partial gradient on the first step).
- SGD, Sutskever form: ``theta - c_d v`` (iterated the same way with weight decay).
- Adam: ``m_k = beta1 m_(k-1) (+ (1-beta1) lambda theta_(k-1) for L2 decay)``,
  ``theta_k = theta_(k-1) - eta_k/(1-beta1^(t+k)) m_k / (sqrt(u)/sqrt(1-beta2^(t+k)) + eps)``
  with ``u`` frozen. AdamW first multiplies ``theta`` by ``1 - eta_k lambda``.
- ``aggmsnag`` (``step_every > 1``): the first predicted step also uses the partially
  accumulated gradient ``p.grad``.

``p.grad`` is only read, never written; predictions are new tensors, never aliases. A
parameter without optimizer state (before the first step) is not predicted under Adam.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ringpipe.pipeline.staleness.lr_lookahead import future_lrs
from ringpipe.pipeline.staleness.optimizer_kind import optimizer_kind, param_groups_of

__all__ = ["WeightPredictor", "momentum_coefficient"]


def momentum_coefficient(gamma: float, d: int) -> float:
    """``c_d = (gamma - gamma^(d+1)) / (1 - gamma) = gamma + ... + gamma^d``."""
    if gamma == 1.0:
        return float(d)
    return (gamma - gamma ** (d + 1)) / (1.0 - gamma)


class WeightPredictor:
    """Predicts and installs the weights ``d`` steps ahead; restores the true ones on ``revert``."""

    def __init__(
        self,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        *,
        aggregate: bool = False,
        nag_with_predictor: bool = False,
    ) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.aggregate = aggregate
        self.nag_with_predictor = nag_with_predictor
        self.kind = optimizer_kind(optimizer)
        self._groups = param_groups_of(self.params, optimizer)
        self._group_index = {id(g): i for i, g in enumerate(optimizer.param_groups)}
        self._true: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def active(self) -> bool:
        """Whether predicted weights are installed now."""
        return bool(self._true)

    def horizon(self, staleness: int) -> int:
        """Steps to predict for a micro-batch of this staleness (``nag_with_predictor``: 1 at 0)."""
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if staleness == 0 and self.nag_with_predictor:
            return 1
        return staleness

    @torch.no_grad()
    def predict(self, staleness: int) -> list[torch.Tensor | None]:
        """The predicted value of each parameter (``None``: unchanged); nothing is modified."""
        d = self.horizon(staleness)
        if d == 0:
            return [None] * len(self.params)
        lrs = future_lrs(self.optimizer, self.scheduler, d)
        out: list[torch.Tensor | None] = []
        for p, group in zip(self.params, self._groups, strict=True):
            eta = lrs[self._group_index[id(group)]]
            state = self.optimizer.state.get(p, {})
            g0 = p.grad.detach() if self.aggregate and p.grad is not None else None
            if self.kind in ("sgd", "sutskever"):
                out.append(self._sgd(p.detach(), group, state, g0, eta))
            else:
                out.append(self._adam(p.detach(), group, state, g0, eta))
        return out

    def setup(self, staleness: int) -> bool:
        """Install the prediction in place; returns whether any parameter changed."""
        if self.active:
            raise RuntimeError("weight prediction is already installed; call revert() first")
        predicted = self.predict(staleness)
        with torch.no_grad():
            for p, new in zip(self.params, predicted, strict=True):
                if new is not None:
                    self._true.append((p, p.detach().clone()))
                    p.copy_(new)
        return self.active

    def revert(self) -> None:
        """Put the true weights back (no-op when no prediction is installed)."""
        with torch.no_grad():
            for p, true in self._true:
                p.copy_(true)
        self._true = []

    def _sgd(
        self,
        theta: torch.Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        g0: torch.Tensor | None,
        eta: list[float],
    ) -> torch.Tensor | None:
        gamma = float(group.get("momentum", 0.0))
        lam = float(group.get("weight_decay", 0.0))
        nesterov = bool(group.get("nesterov", False))
        damp = float(group.get("dampening", 0.0))
        sutskever = self.kind == "sutskever"
        v = state.get("momentum_buffer")
        if lam == 0.0 and g0 is None:
            if v is None or gamma == 0.0:
                return None
            coef = sum(
                (1.0 if sutskever else eta[k]) * gamma ** (k + 1 + (1 if nesterov else 0))
                for k in range(len(eta))
            )
            return theta - coef * v
        th = theta.clone()
        vh = None if v is None else v.clone()
        for k, lr in enumerate(eta):
            dp = th * lam
            if k == 0 and g0 is not None:
                dp = dp + g0
            if sutskever:
                vh = dp * lr if vh is None else vh * gamma + dp * lr
                th -= vh
                continue
            if gamma == 0.0:
                th -= lr * dp
                continue
            vh = dp.clone() if vh is None else vh * gamma + dp * (1.0 - damp)
            th -= lr * (dp + gamma * vh if nesterov else vh)
        return th

    def _adam(
        self,
        theta: torch.Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        g0: torch.Tensor | None,
        eta: list[float],
    ) -> torch.Tensor | None:
        if "exp_avg" not in state:
            return None
        beta1, beta2 = (float(b) for b in group["betas"])
        eps = float(group["eps"])
        lam = float(group.get("weight_decay", 0.0))
        decoupled = self.kind == "adamw"
        t = int(state["step"])
        u = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
        sqrt_u = u.sqrt()
        th = theta.clone()
        m = state["exp_avg"]
        for k, lr in enumerate(eta, start=1):
            if decoupled and lam != 0.0:
                th.mul_(1.0 - lr * lam)
            g = g0 if k == 1 else None
            if not decoupled and lam != 0.0:
                g = th * lam if g is None else g + th * lam
            m = m * beta1 if g is None else m * beta1 + g * (1.0 - beta1)
            bc1 = 1.0 - beta1 ** (t + k)
            bc2 = 1.0 - beta2 ** (t + k)
            denom = sqrt_u / math.sqrt(bc2) + eps
            th -= (lr / bc1) * m / denom
        return th
