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

ZB-H2 (the paper's section 3.1, figure 3) trades memory for the rest of the bubble: a stage
may hold up to ``2 * stages - 1`` micro-batches (the paper's peak, about twice 1F1B's ``stages``),
so it runs extra warm-up forwards where ZB-H1 waits for the first backward, and then ``F``,
``B``, ``W`` per micro-batch. Its action lists are what a greedy pipeline with equal ``F``,
``B`` and ``W`` times does: a free stage runs a backward if its output gradient is there, else
a forward if its input is there and it holds fewer micro-batches than the limit, else a
held-back ``W``. One step has the shape of a parallelogram: the first stage ends ``stages - 1``
before the last (one step alone idles as ZB-H1 does); since a ringpipe stage takes its
optimizer step on its own (no barrier across stages), the next step's forwards start in that
gap, and from step to step a step costs ``m * (tF + tB + tW) + (p - 1)(tF + tB - 2 tW)`` with
equal passes, i.e. no idle time at all (the paper's formula), once ``m >= 2 * stages - 1``.
"""

from __future__ import annotations

from functools import lru_cache

from ringpipe.pipeline.actions import Action, check_args

__all__ = ["zb_h1", "zb_h1_pipeline", "zb_h2", "zb_h2_pipeline", "zb_h2_limit"]


def zb_h1(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Stage ``stage``'s ZB-H1 actions: ``F``, input-gradient ``B``, weight-gradient ``W``, one ``S``."""
    check_args(num_stages, num_microbatches, stage)
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


def zb_h2_limit(num_stages: int) -> int:
    """The most micro-batches (``F`` done, ``W`` not yet) a stage holds under ZB-H2."""
    return 2 * num_stages - 1


def zb_h2(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Stage ``stage``'s ZB-H2 actions: extra warm-up forwards, then ``F``, ``B``, ``W``; one ``S``."""
    check_args(num_stages, num_microbatches, stage)
    return list(_zb_h2(num_stages, num_microbatches)[stage])


def zb_h2_pipeline(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Every stage's ZB-H2 actions."""
    return [zb_h2(num_stages, num_microbatches, s) for s in range(num_stages)]


@lru_cache(maxsize=64)
def _zb_h2(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """The greedy unit-time pipeline of the module docstring, run to the end, as action lists."""
    f_end: list[list[int]] = [[] for _ in range(p)]  # when each stage finished each forward (in order)
    b_end: list[list[int]] = [[] for _ in range(p)]
    w_done = [0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(w_done[s] < m for s in range(p)):
        ran = []
        for s in range(p):
            nf, nb = len(f_end[s]), len(b_end[s])
            grad_in = s == p - 1 or (len(b_end[s + 1]) > nb and b_end[s + 1][nb] <= t)
            act_in = s == 0 or (len(f_end[s - 1]) > nf and f_end[s - 1][nf] <= t)
            if nb < nf and grad_in:
                ran.append((s, Action("B", nb)))
            elif nf < m and act_in and nf - w_done[s] < zb_h2_limit(p):
                ran.append((s, Action("F", nf)))
            elif w_done[s] < nb:
                ran.append((s, Action("W", w_done[s])))
        if t > 6 * (m + p):  # each unit of time runs one action somewhere, or waits for one message
            raise AssertionError(f"ZB-H2 construction for {p} stages and {m} micro-batches did not finish")
        for s, a in ran:  # every action takes one unit: it ends at t + 1, visible to the others then
            out[s].append(a)
            if a.kind == "F":
                f_end[s].append(t + 1)
            elif a.kind == "B":
                b_end[s].append(t + 1)
            else:
                w_done[s] += 1
        t += 1
    return tuple(tuple([*acts, Action("S")]) for acts in out)
