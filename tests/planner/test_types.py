"""The planner's data (remat.Plan, remat.Profile): JSON round trips that keep every field,
unknown fields refused, the table of a plan read back, and a profile an earlier version
wrote planned as it was then.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest
import torch

import remat
from remat import PlanError
from remat.planner.shapefit import fits
from remat.planner.solve import Plan
from remat.planner.stepmodel import allocator_peak
from remat.planner.types import (
    BlockCosts,
    Fit,
    OptimizerTerms,
    Phase,
    ProfileData,
    ScratchTerms,
    SharedTerms,
    Window,
    WindowKind,
)
from tests.support.plans import wide_mlp

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_json_round_trip_and_table():
    p = Plan(
        decisions={"blocks.0": "recompute", "blocks.1": "keep"},
        predicted_peak_bytes=3 * 2**20,
        predicted_overhead_s=0.012,
        unchecked_peak_bytes=5 * 2**20,
        budget_bytes=4 * 2**20,
        saved_bytes={"blocks.0": 2**20, "blocks.1": 0},
        added_cost={"blocks.0": 0.012, "blocks.1": 0.0},
        static_bytes=2**20,
        peak_at="backward of 'blocks.0'",
        breakdown={"static": 2**20, "gradients": 2**19, "optimizer": 0, "activations": 3 * 2**19},
    )
    q = Plan.from_json(p.to_json())
    assert q == p
    text = str(p)
    assert "blocks.0" in text and "recompute" in text and "predicted step peak 3.00 MiB" in text
    assert "peak in backward of 'blocks.0': static 1.00 MiB, gradients 512.00 KiB" in text
    assert "optimizer.step()" not in text  # a movable peak names no lever


def test_plan_table_names_the_lever_when_the_optimizer_step_is_the_peak():
    p = Plan(
        decisions={"blocks.0": "keep"},
        predicted_peak_bytes=4 * 2**20,
        predicted_overhead_s=0.0,
        unchecked_peak_bytes=4 * 2**20,
        budget_bytes=4 * 2**20,
        peak_at="optimizer.step() of the first step (optimizer state created)",
        breakdown={"static": 2**20, "gradients": 2**20, "optimizer": 2**21, "activations": 0},
        peak_movable=False,
        peak_phase=Phase.OPTIMIZER_FIRST,
    )
    text = str(_round_trip(p))
    assert "no checkpointing plan lowers" in text and "shard the optimizer state" in text


def _round_trip(p: Plan) -> Plan:
    q = Plan.from_json(p.to_json())
    assert q == p
    return q


@pytest.mark.parametrize("extra", ['"peak_where": "x"', '"budget": 1'])
def test_plan_from_json_refuses_unknown_fields(extra):
    text = Plan(
        decisions={"blocks.0": "keep"},
        predicted_peak_bytes=1,
        predicted_overhead_s=0.0,
        unchecked_peak_bytes=1,
        budget_bytes=1,
    ).to_json()
    with pytest.raises(PlanError, match="unknown fields"):
        Plan.from_json(text.replace("{", "{" + extra + ", ", 1))


# ---------------------------------------------------------------- plan files


def test_plan_json_round_trip_keeps_the_step_fields():
    model, x = wide_mlp()
    opt = torch.optim.AdamW(model.parameters())
    p = remat.plan(remat.profile(model, x, optimizer=opt, timer="flops"), "100%")
    q = remat.Plan.from_json(p.to_json())
    assert q == p
    assert (q.static_bytes, q.peak_at, q.breakdown, q.peak_movable) == (
        p.static_bytes,
        p.peak_at,
        p.breakdown,
        False,
    )


def test_profile_json_round_trip_keeps_the_step_terms(adamw_profile, tmp_path):
    path = tmp_path / "profile.json"
    adamw_profile.save(str(path))
    loaded = remat.Profile.load(str(path))
    assert loaded == adamw_profile
    for ds in (["keep"] * 3, ["recompute"] * 3):
        assert loaded.peak(ds) == adamw_profile.peak(ds)


def test_plan_from_json_with_unknown_fields_raises(adamw_profile):
    data = remat.plan(adamw_profile, "100%").to_json()
    bad = data.replace('"peak_at"', '"peak_where"')
    with pytest.raises(remat.PlanError, match=r"unknown fields \['peak_where'\]"):
        remat.Plan.from_json(bad)


@pytest.mark.parametrize("kind", list(WindowKind))
def test_window_label_parses_back(kind):
    window = Window(kind, 2) if kind in (WindowKind.FWD, WindowKind.BWD) else Window(kind)
    assert Window.parse(window.label) == window


@pytest.mark.parametrize("kind, block", [(WindowKind.FWD, -1), (WindowKind.TOP, 0)])
def test_window_takes_a_block_exactly_when_it_is_a_blocks(kind, block):
    with pytest.raises(ValueError, match="block index"):
        Window(kind, block)


GROUPS = [OptimizerTerms, ScratchTerms, SharedTerms]


@pytest.mark.parametrize("cls", [ProfileData, BlockCosts, *GROUPS])
def test_every_numeric_field_says_what_the_shape_fit_does_with_it(cls):
    """An int field (bytes) is fitted exactly or, scratch, bounded; a float field is a time;
    the fields the fit reads are those ranks agree over by max or min."""
    scratch = cls is ScratchTerms  # every number of it is scratch
    for f in dataclasses.fields(cls):
        number = re.fullmatch(r"(dict\[\w+, )?(int|float)\]?", str(f.type))
        fit = f.metadata.get("fit")
        if number is None:
            assert fit is None, f.name
            continue
        want = {Fit.TIME} if number.group(2) == "float" else {Fit.EXACT, Fit.BOUND}
        assert fit in want, f"{cls.__name__}.{f.name}: fit {fit}"
        assert f.metadata.get("agree") in ("max", "min"), f.name
        assert (fit is Fit.BOUND) == (scratch or "scratch" in f.name), f.name


def test_the_groups_of_a_profile_are_its_fields_with_group_metadata_named_apart_from_a_blocks():
    groups = {f.type: f.name for f in dataclasses.fields(ProfileData) if f.metadata.get("group")}
    assert groups == {"OptimizerTerms": "optim", "ScratchTerms": "scratch", "SharedTerms": "shared"}
    # a block named as a group ("shared") names no term of the shape fit twice
    def numbers(cls):
        return {f.name for f in dataclasses.fields(cls) if "fit" in f.metadata}

    assert numbers(ScratchTerms) and not any(numbers(g) & numbers(BlockCosts) for g in GROUPS)


# ---------------------------------------------------------------- plan files on disk


def _small_plan() -> Plan:
    return Plan(
        decisions={"blocks.0": "recompute", "blocks.1": "keep"},
        predicted_peak_bytes=3 * 2**20,
        predicted_overhead_s=0.012,
        unchecked_peak_bytes=5 * 2**20,
        budget_bytes=4 * 2**20,
    )


def test_plan_save_and_load_round_trip_through_a_file(tmp_path):
    p = _small_plan()
    path = tmp_path / "plan.json"
    p.save(path)  # a pathlib.Path
    assert remat.Plan.load(path) == p
    assert remat.Plan.load(str(path)) == p  # and a str
    assert remat.Plan.from_json(path.read_text()) == p  # from_json still takes the text


def test_plan_from_json_given_a_path_says_to_call_load(tmp_path):
    path = tmp_path / "plan.json"
    _small_plan().save(path)
    with pytest.raises(PlanError, match=r"is a file: read it with Plan.load\("):
        remat.Plan.from_json(str(path))


@pytest.mark.parametrize(
    "text, match",
    [
        ("not json", "the text is not JSON"),  # a truncated or foreign file
        ("[1, 2]", "expected a JSON object, got list"),  # JSON, but not a plan
    ],
)
def test_plan_load_names_the_file_it_cannot_read_as_a_plan(text, match, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=f"Plan.load\\('{re.escape(str(path))}'\\): {match}"):
        remat.Plan.load(path)


# ---------------------------------------------------------------- profiles written before


#: a profile as remat wrote it before its terms were grouped (29 flat fields): RotaryLM(depth=2)
#: of tests.support.families, AdamW, timer="flops", on CPU; ``pre_scratch`` (256 measured),
#: ``post_scratch`` (0) and ``shared_inputs`` (none) set by hand so that no two of the terms
#: grouped since share a value
FLAT_PROFILE = pathlib.Path(__file__).parent / "data" / "flat_profile.json"

#: what that version's step model answered for it: the step peak of every plan without
#: spans (tensors, and with the scratch inside operators: +256 B, the largest), the span of
#: both blocks under each decision, and its plans at a few budgets
FLAT_PEAKS = {
    "keep,keep": (4179060, 4179316),
    "keep,recompute": (4281716, 4281972),
    "keep,selective": (4740468, 4740724),
    "keep,split": (4277620, 4277876),
    "recompute,keep": (2718708, 2718964),
    "recompute,recompute": (2729332, 2729588),
    "recompute,selective": (3188084, 3188340),
    "recompute,split": (2725236, 2725492),
    "selective,keep": (3843188, 3843444),
    "selective,recompute": (3908980, 3909236),
    "selective,selective": (4367732, 4367988),
    "selective,split": (3904884, 3905140),
    "split,keep": (2714612, 2714868),
    "split,recompute": (2729332, 2729588),
    "split,selective": (3188084, 3188340),
    "split,split": (2725236, 2725492),
}  # fmt: skip
FLAT_SPAN_PEAKS = {"keep": 4281716, "recompute": 2733428, "selective": 4371828, "split": 2729332}
FLAT_PLANS = {  # budget: decisions, predicted peak, scratch, budget bytes, where
    "65%": (["recompute", "keep"], 2718708, 256, 2842481, "backward of 'blocks.0'"),
    "75%": (["recompute", "keep"], 2718708, 256, 3224434, "backward of 'blocks.0'"),
    "85%": (["recompute", "keep"], 2718708, 256, 3606386, "backward of 'blocks.0'"),
    "100%": (["keep", "keep"], 4179060, 256, 4179316, "backward of 'blocks.1'"),
    2714868: (["split", "keep"], 2714612, 256, 2714868, "backward of 'blocks.0'"),
}  # fmt: skip


def test_a_profile_written_in_the_flat_form_reads_into_its_groups():
    flat = json.loads(FLAT_PROFILE.read_text())
    prof = remat.Profile.from_json(FLAT_PROFILE.read_text())
    assert prof.optim == OptimizerTerms("AdamW", 236652, 269932, 33280)
    assert prof.scratch == ScratchTerms(bytes=256, located=True, pre=192, top=8, post=64)
    assert prof.shared == SharedTerms(bytes=32768, inputs={"0,1>2": 4096})
    assert prof.scratch_bytes == 256  # the flat name, kept as a read-only alias
    # the fields that were not grouped read as they were
    # (and "compiled" and "steps", which came later: written only when not the default)
    later = {"compiled", "steps"}
    kept = {f.name for f in dataclasses.fields(ProfileData)} - {"optim", "scratch", "shared"} - later
    assert {k: getattr(prof, k) for k in kept - {"blocks"}} == {k: flat[k] for k in kept - {"blocks"}}
    assert prof.blocks == [BlockCosts(**b) for b in flat["blocks"]]
    # written grouped, and read back equal
    data = json.loads(prof.to_json())
    assert data["scratch"] == {"bytes": 256, "located": True, "pre": 192, "top": 8, "post": 64}
    assert not set(data) & set(flat) - kept
    assert remat.Profile.from_json(prof.to_json()) == prof
    # and the shape fit reads the same numbers, by their grouped names, fitted or bounded as
    # they were
    fit = fits(prof)
    assert fit["scratch.pre"] is fit["blocks.0.bwd_scratch"] is Fit.BOUND
    assert fit["optim.first_bytes"] is fit["shared.inputs[0,1>2]"] is Fit.EXACT


def test_a_profile_written_in_the_flat_form_plans_as_it_did():
    text = FLAT_PROFILE.read_text()
    prof = remat.Profile.from_json(text)
    assert remat.Profile.from_json(prof.to_json()) == prof
    for key, (tensors, allocator) in FLAT_PEAKS.items():
        ds = key.split(",")
        assert (prof.peak(ds).bytes, allocator_peak(prof, ds).bytes) == (tensors, allocator), key
    for d, peak in FLAT_SPAN_PEAKS.items():
        assert prof.peak([d, d], [(0, 1)]).bytes == peak, d
    ends = (prof.unchecked_peak_bytes, prof.floor_bytes, prof.smallest_budget_bytes)
    assert ends == (4179060, 2714612, 2714868)
    for budget, (ds, peak, scratch, budget_bytes, at) in FLAT_PLANS.items():
        p = remat.plan(prof, budget)
        got = (list(p.decisions.values()), p.predicted_peak_bytes, p.scratch_bytes)
        assert got == (ds, peak, scratch), budget
        assert (p.budget_bytes, p.peak_at, p.spans) == (budget_bytes, at, []), budget
