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
    with pytest.raises(ScheduleError, match="valid schedules: 1f1b, async_1f1b, gpipe, interleaved_1f1b, seq, zb_h1"):
        get_schedule("zero_bubble")
    assert set(SCHEDULES) == {"seq", "gpipe", "1f1b", "async_1f1b", "interleaved_1f1b", "zb_h1"}


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
