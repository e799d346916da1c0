"""The ``overlap`` setting: a DistributedOptimizer launches its buckets as they fill, or once backward ends.

Launching each bucket as soon as its gradients are ready (``overlap``, the default, as DDP and
Horovod do) overlaps the reduction with the rest of backward. The overlap is free only where the
transport's threads have cores of their own; where every core already runs backward, the
reduction threads take cores from it, and posting every bucket after backward
(``after_backward``) spends the same CPU time in another order. On a two-core host with a rank
per core, holding the buckets measured 4-5 % slower than overlapping for an MLP and ResNet-18 at
2 ranks, and level within the noise at 4 (``benchmarks/RESULTS.md``), so ``overlap`` stays the
default and ``after_backward`` is a setting for hosts where it measures faster. The choice
changes when buckets are posted, never what is summed or the order in which buckets go out;
like every setting of the optimizer, it is compared across ranks at construction.
"""

from __future__ import annotations

import os

__all__ = ["POLICIES", "policy_setting", "comparable_policy"]

#: The accepted settings.
POLICIES = ("overlap", "after_backward")
_SPELLINGS = {"1": "overlap", "true": "overlap", "0": "after_backward", "false": "after_backward"}


def policy_setting(value: str | bool | None) -> str:
    """The launch policy from the argument, or from ``RINGPIPE_OVERLAP`` when it is None.

    ``True`` means ``"overlap"`` and ``False`` ``"after_backward"`` (so do ``1`` / ``0`` in the
    environment); anything else is refused, naming the accepted values.
    """
    source = "overlap"
    if value is None:
        raw = os.environ.get("RINGPIPE_OVERLAP", "").strip().lower()
        value, source = _SPELLINGS.get(raw, raw or "overlap"), "RINGPIPE_OVERLAP"
    if value is True or value is False:
        return "overlap" if value else "after_backward"
    if value not in POLICIES:
        raise ValueError(f"{source}={value!r} is not a launch policy; use one of {', '.join(POLICIES)} "
                         "(or True / False)")
    return str(value)


def comparable_policy(value: str | bool | None) -> object:
    """What ranks compare at construction: the resolved policy, or an invalid value as given."""
    try:
        return policy_setting(value)
    except ValueError:
        return value
