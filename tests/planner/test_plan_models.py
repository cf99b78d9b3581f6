"""Profile, plan and apply on models unlike the built-in GPT: CNNs with BatchNorm, keyword and tuple
blocks, tied and frozen parameters, uneven and nested blocks, dropout, budgets, plan files."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import nn

import remat
from remat.planner.apply import apply_decision
from remat.planner.auto import step_peaks
from tests.support.tensors import assert_dicts_equal

pytestmark = pytest.mark.usefixtures("one_thread")


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
            for _ in range(4)
        ]
    )


def _cnn_input() -> torch.Tensor:
    return torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:
    """One training step from seed 1 (dropout draws the same mask); the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(*args, **kwargs)
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- 1. CNN with BatchNorm


def test_profile_leaves_batchnorm_running_stats_and_counter_as_they_were():
    model = _cnn()
    before = _state(model)
    remat.profile(model, _cnn_input(), timer="flops", set_to_none=False)
    after = model.state_dict()
    assert_dicts_equal(before, after)  # running_mean, running_var, num_batches_tracked
    assert int(after["0.1.num_batches_tracked"]) == 0


def test_measure_peak_leaves_batchnorm_running_stats_as_they_were():
    model = _cnn()
    before = _state(model)
    remat.measure_peak(model, _cnn_input(), set_to_none=False)
    assert_dicts_equal(before, model.state_dict())


def test_cnn_auto_checkpoint_gives_bitwise_equal_grads_and_one_stats_update():
    model, ref = _cnn(), _cnn()
    x = _cnn_input()
    p = remat.auto_checkpoint(model, x, budget="85%", timer="flops", set_to_none=False)
    assert "recompute" in p.decisions.values() or "selective" in p.decisions.values()
    assert_dicts_equal(_state(ref), _state(model))  # planning took no step of its own
    assert_dicts_equal(_grads(ref, x), _grads(model, x))
    assert_dicts_equal(_state(ref), _state(model))  # the real step updated the stats once
    assert int(model.state_dict()["0.1.num_batches_tracked"]) == 1


# ---------------------------------------------------------------- 2. keywords, tuples


class _KwBlock(nn.Module):
    """Takes a required keyword-only mask, returns (tensor, dict, str)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> tuple:
        y = x + self.down(torch.tanh(self.up(x * mask))) * scale
        return y, {"aux": y.mean(), "steps": 1}, "block"


class _KwModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_KwBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple:
        aux = []
        for b in self.blocks:
            x, extra, _ = b(x, mask=mask, scale=0.5)
            aux.append(extra["aux"])
        return x, torch.stack(aux), "done"


def test_flops_profile_runs_blocks_with_their_keyword_arguments():
    torch.manual_seed(0)
    model = _KwModel()
    x, mask = torch.randn(4, 8), torch.ones(4, 8)
    prof = remat.profile(model, x, mask=mask, timer="flops", set_to_none=False)
    # the two Linear layers: 2 * 4 * (8 * 32 + 32 * 8) FLOPs recomputed per block
    assert [b.cost["recompute"] for b in prof.blocks] == [2 * 4 * 512.0] * 3


def test_plan_on_keyword_tuple_blocks_keeps_gradients_bitwise():
    torch.manual_seed(0)
    model = _KwModel()
    ref = copy.deepcopy(model)
    x, mask = torch.randn(4, 8, requires_grad=True), torch.ones(4, 8)
    p = remat.plan(remat.profile(model, x, mask=mask, timer="flops", set_to_none=False), "85%")
    assert set(p.decisions.values()) != {"keep"}
    p.apply(model)
    assert_dicts_equal(_grads(ref, x, mask=mask), _grads(model, x, mask=mask))


# ---------------------------------------------------------------- 3. tied, frozen, no-grad input


class _Block(nn.Module):
    def __init__(self, lin: nn.Linear, p: float = 0.0) -> None:
        super().__init__()
        self.lin = lin
        self.other = nn.Linear(8, 8)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.other(self.lin(x))))


class _Tied(nn.Module):
    """blocks.0 and blocks.2 share one Linear; the embedding-like stem is frozen."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8).requires_grad_(False)
        shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(
            [_Block(shared, p), _Block(nn.Linear(8, 8), p), _Block(shared, p)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("budget", ["90%", "95%"])
def test_tied_and_frozen_parameters_with_input_without_grad_keep_gradients_bitwise(budget):
    torch.manual_seed(0)
    model = _Tied()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)  # requires no grad
    remat.auto_checkpoint(model, x, budget=budget, timer="flops", set_to_none=False)
    g, g_ref = _grads(model, x), _grads(ref, x)
    assert_dicts_equal(g_ref, g)
    assert "stem.weight" not in g and "blocks.0.lin.weight" in g  # frozen stays frozen


def test_fully_frozen_model_raises_an_error_naming_profile_and_loss_fn():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]).requires_grad_(False)
    with pytest.raises(ValueError, match=r"remat\.profile: .*frozen.*loss_fn="):
        remat.profile(model, torch.randn(4, 8), timer="flops", set_to_none=False)


# ---------------------------------------------------------------- 4. uneven and nested blocks


class _Res(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Linear(hidden, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class _Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Res(8), _Res(256), _Res(16), _Res(512)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_uneven_blocks_predicted_peak_equals_measured_and_narrow_blocks_stay_kept():
    torch.manual_seed(0)
    model, x = _Uneven(), torch.randn(8, 16)
    prof = remat.profile(model, x, timer="flops", set_to_none=False)
    for ds in itertools.product(("keep", "recompute"), repeat=4):
        for block, d in zip(model.blocks, ds):
            apply_decision(block, d)
        assert remat.measure_peak(model, x, set_to_none=False) == prof.peak(ds).bytes, ds
    for block in model.blocks:
        apply_decision(block, "keep")
    # a budget near the unchecked peak: only a wide block is worth changing
    p = remat.plan(prof, "90%")
    assert p.decisions["blocks.0"] == p.decisions["blocks.2"] == "keep"
    assert {p.decisions["blocks.1"], p.decisions["blocks.3"]} != {"keep"}


@pytest.mark.parametrize("nested", [False, True], ids=["chain", "residual-inner-f"])
def test_predicted_peak_is_exact_when_a_block_output_is_only_held_by_a_selective_cache(
    nested,
):
    # Under keep nothing holds a block's output once the next op (the loss, a residual add)
    # has used it; a selective cache holds it (it is a matmul output) until that block's
    # recompute. The prediction used to miss those bytes: a plan could exceed its budget.
    torch.manual_seed(0)
    if nested:
        model = _Staged()
        check = {"check_fn": lambda n, m: n.endswith(".f")}
    else:
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)]
        )
        check = {}
    x = torch.randn(8, 16, requires_grad=True)
    prof = remat.profile(model, x, timer="flops", **check, set_to_none=False)
    blocks = [model.get_submodule(b.name) for b in prof.blocks]
    choices = ("keep", "recompute", "selective")
    for ds in itertools.product(choices, repeat=len(blocks)):  # 27 and 81 plans
        for block, d in zip(blocks, ds):
            apply_decision(block, d)
        assert remat.measure_peak(model, x, set_to_none=False) == prof.peak(ds).bytes, ds


class _Staged(nn.Module):
    """Two stages of residual blocks; the largest container is not where the blocks are."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            [nn.Sequential(_Res(64), _Res(128)), nn.Sequential(_Res(256), _Res(32))]
        )
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = s(x)
        return self.head(x)


def test_check_fn_selecting_nested_blocks_plans_them_and_keeps_gradients_bitwise():
    torch.manual_seed(0)
    model, x = _Staged(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    prof = remat.profile(
        model, x, timer="flops", check_fn=lambda n, m: isinstance(m, _Res), set_to_none=False
    )
    assert [b.name for b in prof.blocks] == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]
    p = remat.plan(prof, "80%")
    p.apply(model)
    assert (
        remat.measure_peak(model, x, set_to_none=False) == p.predicted_peak_bytes <= p.budget_bytes
    )
    assert_dicts_equal(_grads(ref, x), _grads(model, x))


@pytest.mark.parametrize(
    "forward_blocks, count",
    [
        ([0, 1, 2, 1], "'blocks.1' ran 2 times"),  # a block reused
        ([0, 2], "'blocks.1' ran 0 times"),  # a block skipped
    ],
)
def test_profile_rejects_blocks_that_do_not_run_exactly_once(forward_blocks, count):
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in forward_blocks:
                x = torch.tanh(self.blocks[i](x))
            return x

    model = Model()
    before = _state(model)
    for timer in ("flops", "time"):
        with pytest.raises(ValueError, match=f"{count}.*check_fn="):
            remat.profile(model, torch.randn(4, 8), timer=timer, repeats=1, set_to_none=False)
    assert_dicts_equal(before, model.state_dict())


# ---------------------------------------------------------------- 5. train/eval, no_grad


def test_dropout_model_in_train_mode_keeps_gradients_bitwise_and_mode():
    torch.manual_seed(0)
    model = _Tied(p=0.3)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    remat.auto_checkpoint(model, x, budget="90%", timer="flops", set_to_none=False)
    assert model.training
    assert_dicts_equal(_grads(ref, x), _grads(model, x))


def test_eval_mode_profile_stays_in_eval_and_drops_dropout_masks():
    torch.manual_seed(0)
    model = _Tied(p=0.3)
    x = torch.randn(4, 8)
    train_peak = remat.profile(model, x, timer="flops", set_to_none=False).unchecked_peak_bytes
    model.eval()
    eval_peak = remat.profile(model, x, timer="flops", set_to_none=False).unchecked_peak_bytes
    assert not model.training and not any(m.training for m in model.modules())
    assert eval_peak < train_peak  # no dropout masks are saved in eval mode


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: remat.profile(m, x, timer="flops", set_to_none=False),
        lambda m, x: remat.auto_checkpoint(m, x, budget="60%", timer="flops", set_to_none=False),
        lambda m, x: remat.measure_peak(m, x, set_to_none=False),
    ],
    ids=["profile", "auto_checkpoint", "measure_peak"],
)
def test_planning_with_gradients_disabled_says_to_leave_no_grad(context, call):
    model = _cnn()
    x = _cnn_input()
    before = _state(model)
    with context(), pytest.raises(RuntimeError, match=r"no_grad\(\).*torch\.enable_grad\(\)"):
        call(model, x)
    assert_dicts_equal(before, model.state_dict())


# ---------------------------------------------------------------- 6. budgets


@pytest.fixture(scope="module")
def cnn_profile():
    return remat.profile(_cnn(), _cnn_input(), timer="flops", set_to_none=False)


@pytest.mark.parametrize(
    "budget, expected",
    [
        (10**9, 10**9),  # bytes as an int
        ("1.5GiB", int(1.5 * 2**30)),  # a size string
        ("0.5 TiB", 2**39),
        ("100%", 1.0),  # the unchecked peak itself
        ("150%", 1.5),  # more than it: keeping every block fits
    ],
)
def test_good_budgets_are_read_as_bytes(cnn_profile, budget, expected):
    p = remat.plan(cnn_profile, budget)
    if isinstance(expected, float):  # static bytes and scratch inside operators on top
        static = cnn_profile.static_step_bytes
        share = int((cnn_profile.unchecked_peak_bytes - static) * expected)
        expected = static + cnn_profile.scratch.bytes + share
    assert p.budget_bytes == expected
    assert set(p.decisions.values()) == {"keep"}


def test_percent_budget_is_a_share_of_what_the_unchecked_step_allocates(cnn_profile):
    p = remat.plan(cnn_profile, "90%")
    static, scratch = cnn_profile.static_step_bytes, cnn_profile.scratch.bytes
    assert scratch > 0  # oneDNN's convolution backward
    share = int((cnn_profile.unchecked_peak_bytes - static) * 0.9)
    assert p.budget_bytes == static + scratch + share
    assert p.predicted_peak_bytes + scratch <= p.budget_bytes


@pytest.mark.parametrize(
    "bad, error",
    [
        (-5, ValueError),  # negative bytes
        (0, ValueError),
        ("0%", ValueError),  # can never be met
        ("-10%", ValueError),
        ("-1GiB", ValueError),
        ("abc", ValueError),  # unreadable
        (math.nan, ValueError),
        (math.inf, ValueError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_bad_budget_error_names_argument_value_and_what_to_pass(cnn_profile, bad, error):
    with pytest.raises(error) as info:
        remat.plan(cnn_profile, bad)
    assert not isinstance(info.value, remat.PlanError)  # a usage error, not "no plan fits"
    msg = str(info.value)
    assert "budget" in msg and repr(bad) in msg and "'60%'" in msg and "GiB" in msg


# ---------------------------------------------------------------- 7. plan files


def test_plan_json_round_trip_applies_to_a_fresh_instance_with_equal_gradients():
    torch.manual_seed(0)
    model = _Uneven()
    x = torch.randn(8, 16)
    p = remat.plan(remat.profile(model, x, timer="flops", set_to_none=False), "90%")
    loaded = remat.Plan.from_json(p.to_json())
    assert loaded == p
    torch.manual_seed(0)
    fresh = _Uneven()
    ref = copy.deepcopy(fresh)
    loaded.apply(fresh)
    assert remat.measure_peak(fresh, x, set_to_none=False) == p.predicted_peak_bytes
    assert_dicts_equal(_grads(ref, x), _grads(fresh, x))


def test_applying_a_plan_to_a_model_with_other_block_names_raises_and_changes_nothing():
    torch.manual_seed(0)
    p = remat.plan(
        remat.profile(_Uneven(), torch.randn(8, 16), timer="flops", set_to_none=False), "90%"
    )

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([_Res(8), _Res(256), _Res(16), _Res(512)])

    other = Renamed()
    before = repr(other)
    with pytest.raises(remat.PlanError, match=r"no submodule named blocks\.0, blocks\.1"):
        p.apply(other)
    assert repr(other) == before


# ---------------------------------------------------------------- 8. the default step on these models


def _conv_relu() -> nn.Sequential:
    """Blocks whose last op (ReLU) saves its output, no residual: a ResNet block's ending."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()) for _ in range(4)]
    )


# The tests above plan the kept-gradients step (set_to_none=False); these check the default
# step (gradients None, created in backward) on the same unusual models, with and without
# AdamW, for every plan of a small grid: first and later steps measured as predicted.
DEFAULT_STEP_CASES = [
    # tied Linear in blocks 0 and 2: its gradient is created in block 2's backward and
    # accumulated in block 0's; a frozen stem; an input without grad
    pytest.param(lambda: (_Tied(), (torch.randn(4, 8),), {}), None, id="tied-frozen"),
    pytest.param(lambda: (_Tied(p=0.3), (torch.randn(4, 8),), {}), "adamw", id="tied-dropout"),
    pytest.param(
        lambda: (_KwModel(), (torch.randn(4, 8, requires_grad=True),), {"mask": torch.ones(4, 8)}),
        "adamw",
        id="keyword-tuple",
    ),
    pytest.param(lambda: (_Uneven(), (torch.randn(8, 16),), {}), None, id="uneven"),
    pytest.param(lambda: (_cnn(), (_cnn_input(),), {}), None, id="cnn-batchnorm"),
    pytest.param(lambda: (_conv_relu(), (_cnn_input(),), {}), None, id="conv-relu"),
]


@pytest.mark.parametrize("make, optimizer", DEFAULT_STEP_CASES)
def test_default_step_peak_is_predicted_exactly_on_unusual_models(make, optimizer):
    torch.manual_seed(0)
    model, args, kwargs = make()
    opt = None if optimizer is None else torch.optim.AdamW(model.parameters())
    prof = remat.profile(
        model, *args, optimizer=opt, decisions=["keep", "recompute"], timer="flops", **kwargs
    )
    blocks = [model.get_submodule(b.name) for b in prof.blocks]
    wrong = []
    try:
        for ds in itertools.product(prof.decisions, repeat=len(blocks)):
            for block, d in zip(blocks, ds):
                apply_decision(block, d)
            first, later = step_peaks(model, *args, optimizer=opt, steps=2, **kwargs)
            predicted = prof.peak(ds).bytes
            if max(first, later) != predicted or first > predicted:
                wrong.append((ds, first, later, predicted))
    finally:
        for block in blocks:
            apply_decision(block, "keep")
    assert wrong == [], f"{len(wrong)} of {2 ** len(blocks)} plans mispredicted"
