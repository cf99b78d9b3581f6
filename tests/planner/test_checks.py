"""Every option of auto_checkpoint, profile, plan, Shapes and the callbacks is checked before
any step runs: the error names the argument, the value and the fix, and the model is
untouched (no forward ran, no parameter, gradient or wrapping changed)."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.planner.stepmodel import parse_budget, smallest_share
from tests.support.plans import make_model


class _Forwards:
    """Counts the forwards of a model (a forward hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_hook(self)

    def __call__(self, *_: object) -> None:
        self.calls += 1


def _untouched(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[str]]:
    return [p.detach().clone() for p in model.parameters()], [
        type(m).__name__ for m in model.modules()
    ]


def _assert_same(model: torch.nn.Module, before: tuple[list[torch.Tensor], list[str]]) -> None:
    params, kinds = before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert [type(m).__name__ for m in model.modules()] == kinds


BAD_AUTO = [
    # (keywords, what the message names)
    ({"budget": "abc"}, "cannot read budget 'abc'"),
    ({"budget": "50"}, "budget='50' is a bare number: 50% (a share) or 50 bytes"),
    ({"budget": 0.5}, "budget='50%'"),  # torch.compile's float budget: its percentage
    ({"budget": "0%"}, "above 0%"),
    ({"budget": [1]}, "budget must be bytes"),
    ({"budget": "60%", "timer": "flop"}, "timer must be one of"),
    ({"budget": "60%", "loss_fn": "mse"}, "loss_fn must be callable"),
    ({"budget": "60%", "check_fn": "layers"}, "check_fn must be callable"),
    ({"budget": "60%", "quiet": "yes"}, "quiet must be True or False"),
    ({"budget": "60%", "diagnose": 1}, "diagnose must be True or False"),
    ({"budget": "60%", "distributed": "no"}, "distributed must be True, False or None"),
    ({"budget": "60%", "shapes": 1}, "shapes must be a remat.Shapes"),
    ({"budget": "60%", "device": "gpu0"}, "device must name the device"),
    ({"budget": "60%", "optimizer": "adam"}, "optimizer must be a torch.optim.Optimizer"),
    ({"budget": "60%", "set_to_none": None}, "set_to_none must be True or False"),
    ({"budget": "60%", "profile": "p.json"}, "profile= must be a remat.Profile"),
]


@pytest.mark.parametrize("options, names", BAD_AUTO, ids=[repr(o) for o, _ in BAD_AUTO])
def test_auto_checkpoint_refuses_a_bad_option_before_any_step(options, names):
    model, x = make_model("mlp")
    forwards = _Forwards(model)
    before = _untouched(model)
    with pytest.raises((TypeError, ValueError), match="remat.auto_checkpoint: ") as e:
        remat.auto_checkpoint(model, x, **options)
    assert names in str(e.value)
    assert forwards.calls == 0
    _assert_same(model, before)


BAD_PROFILE = [
    ({"timer": "wall"}, "timer must be one of"),
    ({"loss_fn": 3}, "loss_fn must be callable"),
    ({"threads": 0}, "threads must be an int >= 1 or None"),
    ({"repeats": "3"}, "repeats must be an int >= 1"),
    ({"calibration": 5}, "calibration must be a device's name"),
    ({"distributed": "yes"}, "distributed must be True, False or None"),
]


@pytest.mark.parametrize("options, names", BAD_PROFILE, ids=[repr(o) for o, _ in BAD_PROFILE])
def test_profile_refuses_a_bad_option_before_any_step(options, names):
    model, x = make_model("mlp")
    forwards = _Forwards(model)
    with pytest.raises((TypeError, ValueError), match=f"remat.profile: {names}"):
        remat.profile(model, x, **options)
    assert forwards.calls == 0


@pytest.mark.parametrize(
    "options, names",
    [
        ({"sizes": 16}, "sizes=(16,)"),  # one size, not a tuple: the fix shows the tuple
        ({"multiple": 0}, "multiple must be an int >= 1"),
        ({"larger": "clip"}, "larger must be one of"),
        ({"checks": -1}, "checks must be an int >= 0"),
        ({"dims": "seq"}, "dims must be a dimension"),
    ],
)
def test_shapes_refuses_a_bad_option_at_construction(options, names):
    with pytest.raises(ValueError, match="remat.Shapes: ") as e:
        remat.Shapes(**options)
    assert names in str(e.value)


@pytest.mark.parametrize("budget", ["50", "50.5", " 7 ", "+50"])
def test_a_bare_number_string_is_never_read_as_bytes(budget):
    n = budget.strip().lstrip("+")
    with pytest.raises(ValueError, match="is a bare number") as e:
        parse_budget(budget, 0, 1000)
    assert f"'{n}%'" in str(e.value) and f"'{n}B'" in str(e.value)


def test_bytes_written_with_their_unit_or_as_an_int_stay_bytes():
    assert parse_budget("50B", 0, 1000) == 50
    assert parse_budget(50, 0, 1000) == 50


def test_a_bare_number_budget_on_the_command_line_names_both_readings(capsys):
    from remat.cli import main

    assert main(["plan", "--budget", "50", "--model", "mlp", "--timer", "flops"]) == 2
    err = capsys.readouterr().err
    assert "--budget '50'" in err and "'50%'" in err and "'50B'" in err


@pytest.mark.parametrize("low", [401, 550, 700, 701, 999, 1000])
def test_smallest_share_is_the_least_percentage_reaching_the_floor(low):
    share = smallest_share(400, 1000, low)
    assert parse_budget(share, 400, 1000) >= low
    below = float(share.rstrip("%")) - 0.01
    assert below <= 0 or parse_budget(f"{below:.2f}%", 400, 1000) < low


def test_an_unreachable_percentage_says_what_is_fixed_and_the_smallest_reachable_share(
    adamw_profile,
):
    prof = adamw_profile
    with pytest.raises(remat.PlanError) as e:
        remat.plan(prof, "1%")
    msg = str(e.value)
    assert "budget='1%' is a share of the" in msg
    assert "stays under every plan" in msg
    share = msg.rsplit("budget='", 1)[1].split("'")[0]
    # that share is planned; a hundredth of a percent less is refused
    assert remat.plan(prof, share).budget_bytes >= prof.smallest_budget_bytes
    with pytest.raises(remat.PlanError):
        remat.plan(prof, f"{float(share.rstrip('%')) - 0.01:.2f}%")


def _meta_mlp() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: remat.auto_checkpoint(m, x, budget="90%", timer="flops", quiet=True),
        lambda m, x: remat.profile(m, x, timer="flops"),
        lambda m, x: remat.measure_peak(m, x),
    ],
    ids=["auto_checkpoint", "profile", "measure_peak"],
)
def test_a_meta_model_with_real_inputs_gets_remats_error_naming_the_two_fixes(call):
    model = _meta_mlp()
    with pytest.raises(ValueError, match="on the meta device and its inputs on cpu") as e:
        call(model, torch.randn(4, 16))
    assert 'device="meta"' in str(e.value) and "model.to_empty(device=...)" in str(e.value)


def test_a_meta_model_with_meta_inputs_is_planned_from_shapes():
    model = _meta_mlp()
    plan = remat.auto_checkpoint(
        model, torch.empty(4, 16, device="meta"), budget="100%", timer="flops", quiet=True
    )
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_auto_checkpoint_refusing_a_percentage_names_the_smallest_reachable_share():
    model, x = make_model("mlp")
    before = _untouched(model)
    with pytest.raises(remat.PlanError, match="the smallest reachable share is budget='"):
        remat.auto_checkpoint(model, x, budget="1%", timer="flops", quiet=True)
    _assert_same(model, before)


def test_token_ids_on_the_host_beside_a_meta_model_are_planned_as_before():
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Embedding(32, 16), *[torch.nn.Linear(16, 16) for _ in range(3)]
        )
    ids = torch.randint(0, 32, (4, 8))  # indices: torch's meta kernels read them from the host
    plan = remat.auto_checkpoint(model, ids, budget="100%", timer="flops", quiet=True)
    assert plan.predicted_peak_bytes <= plan.budget_bytes


@pytest.mark.parametrize("inputs_on", ["meta", "cpu"])
@pytest.mark.parametrize("run", [remat.verify, remat.explain], ids=["verify", "explain"])
def test_verify_and_explain_of_a_meta_model_get_remats_error_naming_what_to_do(run, inputs_on):
    model = _meta_mlp()
    x = torch.empty(4, 16, device="meta") if inputs_on == "meta" else torch.randn(4, 16)
    with pytest.raises(ValueError, match="on the meta device") as e:
        run(model, x)
    assert "model.to_empty(device=...)" in str(e.value)


def test_shapes_refusing_a_percentage_names_the_smallest_reachable_share():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
            for _ in range(4)
        ]
    )
    batch = torch.randn(4, 32, 16)  # (batch, seq, features)
    with pytest.raises(remat.PlanError, match="the smallest reachable share is budget='"):
        remat.auto_checkpoint(
            model, batch, budget="1%", timer="flops", quiet=True, shapes=remat.Shapes(dims=1)
        )
