"""Pipeline schedules as data: properties checked without any process."""

import pytest

from ringpipe.pipeline.executor import staleness_of
from ringpipe.pipeline.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    async_1f1b,
    format_actions,
    get_schedule,
    max_in_flight,
    parse,
    render,
    staleness_at_forward,
    validate,
    validate_pipeline,
)
from ringpipe.pipeline.simulator import async_stage_order

SHAPES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 8), (5, 3)]


@pytest.mark.parametrize("name", ["seq", "gpipe", "1f1b", "async_1f1b"])
@pytest.mark.parametrize(("stages", "mbs"), SHAPES)
def test_forward_precedes_backward_and_pipeline_runs(name, stages, mbs):
    per_stage = [get_schedule(name)(stages, mbs, s) for s in range(stages)]
    validate_pipeline(per_stage, mbs)  # also checks for deadlock and message order
    for acts in per_stage:
        seen_f = set()
        for a in acts:
            if a.kind == "F":
                seen_f.add(a.mb)
            elif a.kind == "B":
                assert a.mb in seen_f
        assert sorted(a.mb for a in acts if a.kind == "F") == list(range(mbs))
        assert sorted(a.mb for a in acts if a.kind == "B") == list(range(mbs))


@pytest.mark.parametrize(("stages", "mbs"), SHAPES)
def test_1f1b_activation_bound(stages, mbs):
    for s in range(stages):
        acts = get_schedule("1f1b")(stages, mbs, s)
        assert max_in_flight(acts) <= stages - s
        assert max_in_flight(acts) == min(stages - s, mbs)
        assert max_in_flight(async_1f1b(stages, mbs, s, 2)) <= stages - s
        # GPipe holds every micro-batch: the reason for 1F1B.
        assert max_in_flight(get_schedule("gpipe")(stages, mbs, s)) == mbs


def test_text_form_and_render():
    assert format_actions(get_schedule("1f1b")(2, 4, 0)) == "F0 F1 B0 F2 B1 F3 B2 B3 S"
    assert format_actions(get_schedule("gpipe")(2, 3, 1)) == "F0 F1 F2 B0 B1 B2 S"
    assert format_actions(get_schedule("seq")(3, 2, 2)) == "F0 B0 F1 B1 S"
    assert format_actions(async_1f1b(2, 4, 0, 2)) == "F0 F1 B0 F2 B1 S F3 B2 B3 S"
    text = "F0 F1 B0 F2 B1 S F3 B2 B3 S"
    assert format_actions(parse(text)) == text
    chart = render([get_schedule("1f1b")(2, 2, s) for s in range(2)])
    assert chart.splitlines()[0].startswith("stage 0: F0 F1 B0 B1 S")


def test_registry_error_lists_names():
    with pytest.raises(ScheduleError, match="valid schedules: 1f1b, async_1f1b, gpipe, interleaved_1f1b, seq, zb_h1, zb_h2"):
        get_schedule("zero_bubble")
    assert set(SCHEDULES) == {"seq", "gpipe", "1f1b", "async_1f1b", "interleaved_1f1b", "zb_h1", "zb_h2"}


def test_validator_rejects_bad_schedules():
    with pytest.raises(ScheduleError, match="backward of micro-batch 1 before its forward"):
        validate(parse("F0 B1 F1 B0 S"), 2)
    with pytest.raises(ScheduleError, match="no backward"):
        validate(parse("F0 F1 B0 S"), 2)
    with pytest.raises(ScheduleError, match="end with a step"):
        validate(parse("F0 B0"), 1)
    with pytest.raises(ScheduleError, match="appears twice"):
        validate(parse("F0 F0 B0 S"), 1)
    with pytest.raises(ScheduleError, match="cannot parse"):
        parse("F0 X1")
    # stage 1 wants B1 before B0 but stage 0 sends... backward order differs: refused
    with pytest.raises(ScheduleError, match="deadlocks|different orders"):
        validate_pipeline([parse("F0 F1 B0 B1 S"), parse("F0 F1 B1 B0 S")], 2)
    with pytest.raises(ScheduleError, match="stage 5 is not in"):
        get_schedule("gpipe")(2, 2, 5)


@pytest.mark.parametrize("step_every", [1, 2, 3])
@pytest.mark.parametrize(("stages", "mbs"), [(2, 6), (3, 7), (4, 9)])
def test_async_staleness_matches_formula(stages, mbs, step_every):
    for s in range(stages):
        acts = async_1f1b(stages, mbs, s, step_every)
        assert staleness_of(acts) == staleness_at_forward(acts, step_every)
        if step_every == 1:
            # steady state: d = N - 1 - i; warm-up micro-batch j has seen j steps at most
            d = staleness_of(acts)
            assert all(v == stages - 1 - s for j, v in d.items() if j >= stages - s)
        steps = sum(1 for a in acts if a.kind == "S")
        assert steps == -(-mbs // step_every)
    for name in ("seq", "gpipe", "1f1b"):
        assert set(staleness_of(get_schedule(name)(stages, mbs, 0)).values()) == {0}


@pytest.mark.parametrize("step_every", [1, 2])
@pytest.mark.parametrize(("stages", "mbs"), [(2, 5), (3, 6), (4, 4)])
def test_async_order_matches_simulator(stages, mbs, step_every):
    for s in range(stages):
        ours = format_actions(async_1f1b(stages, mbs, s, step_every)).split()
        assert ours == async_stage_order(s, stages, mbs, step_every)


def test_action_str():
    assert str(Action("F", 3)) == "F3" and str(Action("S")) == "S"


# ---------------------------------------------------------------- interleaved 1F1B and ZB-H1

NEW_SHAPES = [(2, 2), (2, 4), (2, 8), (3, 3), (3, 6), (4, 4), (4, 8), (4, 12)]


def _per_stage(name, stages, mbs, **kw):
    return [get_schedule(name)(stages, mbs, s, **kw) for s in range(stages)]


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize(("stages", "mbs"), NEW_SHAPES)
def test_interleaved_runs_every_chunk_of_every_microbatch_in_a_legal_order(stages, mbs, chunks):
    per_stage = _per_stage("interleaved_1f1b", stages, mbs, chunks=chunks)
    validate_pipeline(per_stage, mbs)  # deadlock-free, same message order on both sides of every boundary
    for acts in per_stage:
        assert acts[-1] == Action("S") and sum(a.kind == "S" for a in acts) == 1
        for c in range(chunks):
            fwd = [a.mb for a in acts if a.kind == "F" and a.chunk == c]
            bwd = [a.mb for a in acts if a.kind == "B" and a.chunk == c]
            assert sorted(fwd) == list(range(mbs)) and sorted(bwd) == list(range(mbs))
            for m in range(mbs):
                assert acts.index(Action("F", m, c)) < acts.index(Action("B", m, c))
        # a micro-batch's backward walks the chunks in reverse: chunk c+1's B before chunk c's
        for m in range(mbs):
            for c in range(chunks - 1):
                assert acts.index(Action("B", m, c + 1)) < acts.index(Action("B", m, c))


def test_interleaved_with_one_chunk_is_1f1b_and_refuses_uneven_groups():
    for s in range(3):
        assert get_schedule("interleaved_1f1b")(3, 5, s, chunks=1) == get_schedule("1f1b")(3, 5, s)
    with pytest.raises(ScheduleError, match=r"multiple of stages \(4\).*use 8 micro-batches"):
        get_schedule("interleaved_1f1b")(4, 6, 0)
    with pytest.raises(ScheduleError, match="chunks must be >= 1"):
        get_schedule("interleaved_1f1b")(2, 4, 0, chunks=0)


def test_interleaved_text_form():
    # Megatron-LM's order for 2 ranks, 2 chunks, 4 micro-batches: 2*(2-0-1) + (2-1)*2 = 4 warm-up forwards
    assert format_actions(get_schedule("interleaved_1f1b")(2, 4, 0)) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3 S"
    )
    text = "F0 F0.1 B0.1 W0.1 B0 W0 S"
    assert format_actions(parse(text)) == text
    assert parse("F2.0") == [Action("F", 2)]


@pytest.mark.parametrize(("stages", "mbs"), NEW_SHAPES + [(1, 3), (3, 1), (4, 2), (5, 7)])
def test_zb_h1_splits_every_backward_in_a_legal_order(stages, mbs):
    per_stage = _per_stage("zb_h1", stages, mbs)
    validate_pipeline(per_stage, mbs)
    for s, acts in enumerate(per_stage):
        for m in range(mbs):
            f, b, w = (acts.index(Action(k, m)) for k in "FBW")
            assert f < b < w < len(acts) - 1  # F, then B, then W, all before the step
        assert acts[-1] == Action("S") and sum(a.kind == "S" for a in acts) == 1
        # F and B in 1F1B's order: only where the W passes go differs
        assert [a for a in acts if a.kind in "FB"] == [a for a in get_schedule("1f1b")(stages, mbs, s) if a.kind in "FB"]


@pytest.mark.parametrize(("stages", "mbs"), NEW_SHAPES + [(4, 2), (5, 7)])
def test_zb_h1_holds_no_more_activations_than_1f1b(stages, mbs):
    zb, ofob = _per_stage("zb_h1", stages, mbs), _per_stage("1f1b", stages, mbs)
    # the pipeline's peak (the first stage of 1F1B holds min(stages, microbatches) micro-batches)
    assert max(max_in_flight(a) for a in zb) == max(max_in_flight(a) for a in ofob) == min(stages, mbs)
    for acts in zb:  # counted by hand: from F to W
        live = peak = 0
        for a in acts:
            live += (a.kind == "F") - (a.kind == "W")
            peak = max(peak, live)
        assert peak <= min(stages, mbs)


@pytest.mark.parametrize(("stages", "mbs"), NEW_SHAPES + [(1, 3), (3, 1), (4, 2), (5, 7), (4, 16)])
def test_zb_h2_splits_every_backward_and_holds_at_most_2p_minus_1(stages, mbs):
    per_stage = _per_stage("zb_h2", stages, mbs)
    validate_pipeline(per_stage, mbs)
    for acts in per_stage:
        for m in range(mbs):
            f, b, w = (acts.index(Action(k, m)) for k in "FBW")
            assert f < b < w < len(acts) - 1
        assert acts[-1] == Action("S") and sum(a.kind == "S" for a in acts) == 1
    # the paper's peak: 2p - 1 micro-batches (1F1B's first stage holds p), reached on the first stage
    assert [max_in_flight(a) for a in per_stage][0] == min(2 * stages - 1, mbs)
    assert max(max_in_flight(a) for a in per_stage) <= 2 * stages - 1


def test_zb_h2_text_form_two_stages():
    # three warm-up forwards on the first stage (2p - 1 = 3 held), W passes where ZB-H1 would wait
    assert format_actions(get_schedule("zb_h2")(2, 4, 0)) == "F0 F1 F2 B0 W0 B1 F3 B2 W1 W2 B3 W3 S"
    assert format_actions(get_schedule("zb_h2")(2, 4, 1)) == "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3 S"


def test_validator_rejects_bad_split_backwards_and_chunks():
    with pytest.raises(ScheduleError, match="weight-gradient pass of micro-batch 0 before its backward"):
        validate(parse("F0 W0 B0 S"), 1)
    with pytest.raises(ScheduleError, match=r"micro-batches \[1\] of chunk 0 have no weight-gradient pass"):
        validate(parse("F0 F1 B0 W0 B1 S"), 2)
    with pytest.raises(ScheduleError, match="uses chunks"):
        validate(parse("F0 F0.2 B0.2 B0 S"), 1)
    with pytest.raises(ScheduleError, match="forwards in different orders"):
        validate_pipeline([parse("F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1 S"),
                           parse("F0 F1 F1.1 F0.1 B0.1 B1.1 B0 B1 S")], 2)


# ------------------------------------------------------------------------------ module layout

SCHEDULE_MODULES = ["actions", "schedule_checks", "schedules", "schedules_interleaved", "zero_bubble"]

#: One interpreter imports torch (no ringpipe module), then forks a child per schedule module that
#: imports that module first: an import cycle shows in the child as it would in a fresh program,
#: and torch's start-up is paid once instead of once per module.
FIRST_IMPORTS = r"""
import json, os, sys
import torch  # noqa: F401 - before the forks; no ringpipe module yet
results = {}
for module in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            fresh = not any(name == "ringpipe" or name.startswith("ringpipe.") for name in sys.modules)
            __import__(f"ringpipe.pipeline.{module}")
            from ringpipe.pipeline.schedules import SCHEDULES
            out = {"fresh": fresh, "schedules": sorted(SCHEDULES)}
        except BaseException as exc:
            import traceback
            out = {"error": traceback.format_exc()}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        results[module] = json.loads(f.read() or '{"error": "the child wrote nothing"}')
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def first_imports():
    """Each schedule module imported first by a process with no ringpipe module loaded: its result."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, *SCHEDULE_MODULES], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.parametrize("module", SCHEDULE_MODULES)
def test_each_schedule_module_imports_first_in_a_fresh_interpreter(first_imports, module):
    """No import cycle: whichever schedule module a program imports first, it loads, and the registry is whole."""
    got = first_imports[module]
    assert "error" not in got, got.get("error")
    assert got["fresh"]  # no ringpipe module was loaded before this one
    assert got["schedules"] == sorted(["seq", "gpipe", "1f1b", "async_1f1b", "interleaved_1f1b", "zb_h1", "zb_h2"])


def test_schedules_module_still_offers_every_public_name():
    """Action, the checks and the schedules live in their own modules; ``schedules`` re-exports them all."""
    from ringpipe.pipeline import actions, schedule_checks, schedules

    for name in ["Action", "ScheduleError", "SCHEDULES", "ASYNC_SCHEDULES", "parse", "format_actions", "seq", "gpipe",
                 "one_f_one_b", "async_1f1b", "async_1f1b_window", "async_staleness", "get_schedule", "validate",
                 "validate_pipeline", "num_chunks", "max_in_flight", "staleness_at_forward", "render"]:
        assert name in schedules.__all__ and hasattr(schedules, name), name
    assert schedules.Action is actions.Action and schedules.validate is schedule_checks.validate
