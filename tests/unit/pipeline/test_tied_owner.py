"""The mirror's delay ``D`` of a tied weight in the asynchronous pipeline, checked on the 1F1B stream's action lists.

A mirror at stage ``s`` (owner at stage ``f``) takes, after its ``j``-th step, the owner's
weights after the owner's step ``j - D``, ``D = ceil((s - f) / step_every)``. Written out from
:func:`~ringpipe.pipeline.schedules.async_1f1b_window` (the stream cut into windows of ``m``
micro-batches, as ``stream_step`` runs it, then the drain):

- the owner's step ``j - D`` comes, in the owner's own order, before its forward of the first
  micro-batch the mirror has not forwarded at its step ``j``: in the steady state the update is
  there before the mirror needs it, and it is never in a later window than the mirror's step;
- with ``D - 1`` that fails for some step: the owner's update waits on a forward the mirror
  has already passed (so, with equal stage times, the mirror would wait), and on 2 stages the
  update even falls into a later window (``stream_step`` would wait across the caller's code
  between batches).
"""

import itertools

import pytest

from ringpipe.pipeline.schedules import async_1f1b_window
from ringpipe.pipeline.tied_owner import mirror_delay


def steps_of(stages, stage, k, m, batches):
    """Per optimizer step of ``stage``: (its window, forwards it ran before it); the drain is the last window."""
    out, forwards = [], 0
    windows = [async_1f1b_window(stages, stage, b * m, (b + 1) * m, k) for b in range(batches)]
    windows.append(async_1f1b_window(stages, stage, batches * m, batches * m, k, total=batches * m))
    for w, actions in enumerate(windows):
        for a in actions:
            if a.kind == "F":
                forwards += 1
            elif a.kind == "S":
                out.append((w, forwards))
    return out


def violations(stages, f, s, k, m, batches, delay):
    """The mirror's steps ``j`` whose owner update ``j - delay`` comes too late: (in the steady state, across windows)."""
    owner, mirror = steps_of(stages, f, k, m, batches), steps_of(stages, s, k, m, batches)
    assert len(owner) == len(mirror)  # the k-th steps pair up
    late, later_window = [], []
    for j in range(delay + 1, len(mirror) + 1):
        (w_o, f_o), (w_m, f_m) = owner[j - delay - 1], mirror[j - 1]
        if f_o > f_m:
            late.append(j)
        if w_o > w_m:
            later_window.append(j)
    return late, later_window


CONFIGS = [(n, f, s, k) for n in range(2, 6) for f, s in itertools.combinations(range(n), 2) for k in (1, 2, 3)]


@pytest.mark.parametrize("stages,f,s,k", CONFIGS)
def test_the_owner_update_a_mirror_takes_is_never_late(stages, f, s, k):
    d = mirror_delay(f, s, k)
    assert d == -(-(s - f) // k) >= 1
    for m in (k, 2 * k, 4 * k):  # stream_step needs step_every to divide the batch's micro-batches
        late, later_window = violations(stages, f, s, k, m, 5, d)
        assert late == [] and later_window == [], (m, late, later_window)


@pytest.mark.parametrize("stages,f,s,k", CONFIGS)
def test_one_step_less_would_make_the_mirror_wait(stages, f, s, k):
    d = mirror_delay(f, s, k)
    late, _ = violations(stages, f, s, k, 2 * k, 5, d - 1)
    assert late, "D - 1 would already be early enough"


@pytest.mark.parametrize("k", [1, 2, 3])
def test_one_step_less_on_two_stages_falls_into_a_later_window(k):
    _, later_window = violations(2, 0, 1, k, k, 5, mirror_delay(0, 1, k) - 1)
    assert later_window


def test_a_mirror_comes_after_its_owner():
    with pytest.raises(ValueError, match="after its owner"):
        mirror_delay(2, 1, 1)
