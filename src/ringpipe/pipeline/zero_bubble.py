"""Zero-bubble pipeline schedule ZB-H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism") as data.

The backward of a stage is two passes: ``B`` computes only the gradient of the stage input
(what the previous stage waits for), ``W`` the gradient of the stage's weights (what nobody
waits for but the optimizer step). Moving ``W`` passes into what would be bubble shortens the
critical path: with forward, input-gradient and weight-gradient passes of times ``tF``,
``tB`` and ``tW``, 1F1B idles ``(stages - 1) * (tF + tB + tW)`` per step and ZB-H1
``(stages - 1) * (tF + tB - tW)`` (the paper's section 3.1), a third of it when the three
are equal.

ZB-H1 keeps 1F1B's peak activation memory (the paper's section 2.1): the order of ``F`` and
``B`` is 1F1B's (stage ``s`` of ``n`` runs ``n - s - 1`` warm-up forwards, then one forward /
one backward), and stage ``s`` holds back its first ``s`` weight-gradient passes: after ``B j``
it runs ``W (j - s)``. A micro-batch's activations are held from its ``F`` to its ``W``, so
every stage holds at most ``min(stages, microbatches)`` micro-batches, the number the first
stage of 1F1B holds (later stages hold more than under 1F1B, never more than the first); the
held-back ``W`` passes run at the end, where the stage would otherwise wait. With ``tF = tB
= tW`` and ``microbatches >= stages`` the idle time is ``(stages - 1) * tF`` per stage, a
third of 1F1B's.
"""

from __future__ import annotations

from ringpipe.pipeline.schedules import Action, _check_args

__all__ = ["zb_h1", "zb_h1_pipeline"]


def zb_h1(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Stage ``stage``'s ZB-H1 actions: ``F``, input-gradient ``B``, weight-gradient ``W``, one ``S``."""
    _check_args(num_stages, num_microbatches, stage)
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    delay = stage  # W passes held back, so every stage holds min(stages, microbatches) micro-batches
    out = [Action("F", j) for j in range(warmup)]
    next_w = 0

    def after_backward(j: int) -> None:
        nonlocal next_w
        if j - delay >= next_w:
            out.append(Action("W", next_w))
            next_w += 1

    for j in range(m - warmup):
        out += [Action("F", warmup + j), Action("B", j)]
        after_backward(j)
    for j in range(m - warmup, m):
        out.append(Action("B", j))
        after_backward(j)
    out += [Action("W", j) for j in range(next_w, m)]
    return out + [Action("S")]


def zb_h1_pipeline(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Every stage's ZB-H1 actions."""
    return [zb_h1(num_stages, num_microbatches, s) for s in range(num_stages)]
