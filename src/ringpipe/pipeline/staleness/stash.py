"""Weight stashing (PipeDream): keep the weights a forward used until its backward.

At forward time the stage's parameters (after any prediction) are cloned under a key: the
micro-batch's, or the weight version's when several forwards ran on the same weights. At
backward time the true weights are put aside, the stash is copied into
the parameters (in place), the backward runs, and the true weights come back before the
optimizer steps on them. Stashes are clones, never references, so later updates of the
parameters do not change them (and they stay correct together with weight prediction).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

__all__ = ["WeightStash"]


class WeightStash:
    """Clones of a stage's parameters keyed by micro-batch (or step), and the load/restore around backward."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = list(params)
        self._stashes: dict[Hashable, list[torch.Tensor]] = {}
        self._true: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._stashes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._stashes

    def keys(self) -> list[Hashable]:
        """The keys stashed now, oldest first."""
        return list(self._stashes)

    @property
    def nbytes(self) -> int:
        """Bytes held by all stashes (the memory cost of stashing)."""
        return sum(t.numel() * t.element_size() for ts in self._stashes.values() for t in ts)

    @property
    def loaded(self) -> bool:
        """Whether a stash is installed in the parameters now (true weights put aside)."""
        return self._true is not None

    @torch.no_grad()
    def stash(self, key: Hashable) -> None:
        """Clone the current parameters under ``key``."""
        if key in self._stashes:
            raise KeyError(f"{key!r} is already stashed; pop it after its backward")
        self._stashes[key] = [p.detach().clone() for p in self.params]

    def get(self, key: Hashable) -> list[torch.Tensor]:
        """The stashed tensors of ``key`` (not removed)."""
        try:
            return self._stashes[key]
        except KeyError:
            raise KeyError(f"no stash for {key!r}; stashed: {sorted(map(str, self._stashes))}") from None

    def pop(self, key: Hashable) -> list[torch.Tensor]:
        """Remove and return the stash of ``key``."""
        value = self.get(key)
        del self._stashes[key]
        return value

    @torch.no_grad()
    def load(self, key: Hashable) -> None:
        """Put the true weights aside and copy the stash of ``key`` into the parameters."""
        if self._true is not None:
            raise RuntimeError("a stash is already loaded; call restore() first")
        stashed = self.get(key)
        self._true = [p.detach().clone() for p in self.params]
        for p, s in zip(self.params, stashed, strict=True):
            p.copy_(s)

    @torch.no_grad()
    def restore(self) -> None:
        """Copy the true weights back into the parameters (no-op when nothing is loaded)."""
        if self._true is None:
            return
        for p, t in zip(self.params, self._true, strict=True):
            p.copy_(t)
        self._true = None

    @torch.no_grad()
    def gap(self, key: Hashable) -> list[torch.Tensor]:
        """``|theta_true - theta_stashed|`` per parameter for the stash of ``key``."""
        true = self._true if self._true is not None else [p.detach() for p in self.params]
        return [(t - s).abs() for t, s in zip(true, self.get(key), strict=True)]
