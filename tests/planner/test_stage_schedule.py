"""The moments of a pipeline schedule on one stage (``stepmodel/schedule.py``): the order of
torch's loops and what each moment holds."""

from __future__ import annotations

import pytest

from remat.planner.stepmodel.schedule import Action, in_flight, stage_events


def _order(events) -> str:
    return " ".join(
        f"{e.action.value}{e.microbatch}" for e in events if e.action is not Action.BETWEEN
    )


@pytest.mark.parametrize(
    "schedule, stage, stages, n, order",
    [
        # GPipe: every forward, then every backward
        ("gpipe", 0, 2, 3, "F0 F1 F2 B0 B1 B2"),
        # 1F1B, first of two stages: two warm-up forwards, then one backward one forward
        ("1f1b", 0, 2, 4, "F0 F1 B0 F2 B1 F3 B2 B3"),
        # 1F1B, last stage: each backward right after its forward
        ("1f1b", 1, 2, 4, "F0 B0 F1 B1 F2 B2 F3 B3"),
        # 1F1B, first of four with as many microbatches: all warm-up, then cool-down
        ("1f1b", 0, 4, 4, "F0 F1 F2 F3 B0 B1 B2 B3"),
    ],
)
def test_events_follow_torchs_loop_order(schedule, stage, stages, n, order):
    assert _order(stage_events(schedule, stage=stage, stages=stages, microbatches=n)) == order


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "Schedule1F1B", "ScheduleGPipe"])
@pytest.mark.parametrize("stages, n", [(2, 4), (4, 4), (4, 8)])
def test_most_in_flight_is_the_schedules(schedule, stages, n):
    for s in range(stages):
        events = stage_events(schedule, stage=s, stages=stages, microbatches=n)
        running = [e.in_flight + 1 for e in events if e.action is not Action.BETWEEN]
        assert max(running) == in_flight(schedule, s, stages, n)


def test_one_f_one_b_first_stage_holds_more():
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]


def test_gpipe_sends_hold_every_finished_microbatch_to_the_end():
    mid = stage_events("gpipe", stage=1, stages=3, microbatches=3)
    backs = [e for e in mid if e.action is Action.BACKWARD]
    assert [(e.outputs, e.input_grads) for e in backs] == [(0, 0), (1, 1), (2, 2)]
    assert [e.grads for e in backs] == [False, True, True]  # the first backward creates them
    assert (mid[-1].outputs, mid[-1].input_grads) == (3, 3)


def test_last_stage_keeps_losses_and_merges_outputs_when_returned():
    events = stage_events("1f1b", stage=1, stages=2, microbatches=3)
    assert [e.losses for e in events if e.action is Action.FORWARD] == [0, 1, 2]
    assert events[-1].merged and events[-1].outputs == 3
    quiet = stage_events("1f1b", stage=1, stages=2, microbatches=3, return_outputs=False)
    assert not any(e.merged for e in quiet)
    assert max(e.outputs for e in quiet) == 1  # the loop's `output` variable


def test_first_stage_sends_no_gradients():
    events = stage_events("1f1b", stage=0, stages=2, microbatches=4)
    assert all(e.input_grads == 0 and e.losses == 0 for e in events)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule="interleaved", stage=0, stages=2, microbatches=4), "schedule must be"),
        (dict(schedule="1f1b", stage=0, stages=4, microbatches=2), "at least"),
        (dict(schedule="gpipe", stage=2, stages=2, microbatches=2), "stage must be"),
    ],
)
def test_refuses_what_torch_refuses(kwargs, match):
    schedule = kwargs.pop("schedule")
    with pytest.raises(ValueError, match=match):
        stage_events(schedule, **kwargs)


def test_held_bytes_counts_each_kind_once():
    from remat.planner.stepmodel.stage import StageBytes, held_bytes

    sizes = StageBytes(
        static=1000,
        optimizer_state=200,
        grads=300,
        kept_keep=50,
        output=7,
        input_grad=5,
        loss=4,
        microbatches=3,
    )
    end = stage_events("gpipe", stage=1, stages=2, microbatches=3)[-1]
    assert end.merged and end.grads and end.in_flight == 0
    # static + state + grads + 3 held outputs + 3 input grads + 3 losses + 3 merged outputs
    assert held_bytes(sizes, end, per_mb=50) == 1000 + 200 + 300 + 21 + 15 + 12 + 21
