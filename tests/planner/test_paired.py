"""Profiles from pair steps (:mod:`remat.planner.grouped`): the byte terms of a profile whose
``keep``, ``selective`` and ``split`` lines were assembled from steps holding two blocks under
the decision at a time equal those of the uniform steps, field for field (Hugging Face LLMs
with masks and rotary tables every layer receives included); no pair step holds more than
its pattern's predicted peak; Hugging Face T5 never below; inside the loop's autocast region
the same (Hugging Face LLMs never below); a model with a tensor handed to several blocks and
an autocast region that ends inside its forward is refused (and ``auto_checkpoint`` falls
back, said) (#31 item 1, a batch too small to fit)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner import measure
from remat.planner.grouped import pair_patterns
from remat.planner.inputs import Inputs
from remat.planner.loop import Loop
from remat.planner.stepmodel import located
from remat.planner.types import Decision
from tests.support import families as F
from tests.support.plans import measured_differences
from tests.support.vision_models import ResNet

pytestmark = pytest.mark.usefixtures("one_thread")

Case = Callable[[], tuple[nn.Module, tuple[Any, ...], Any]]


def _gpt() -> tuple[nn.Module, tuple[Any, ...], Any]:
    cfg = ModelConfig(layers=5, d_model=64, seq=64, batch=2, heads=2, vocab=128)
    return build(cfg), (example_input(cfg),), None


def _case(make: Callable[[], nn.Module], *args: Any, loss: Any = None) -> Case:
    def built() -> tuple[nn.Module, tuple[Any, ...], Any]:
        torch.manual_seed(0)
        return make(), args, loss

    return built


def _hf(name: str) -> Case:
    def built() -> tuple[nn.Module, tuple[Any, ...], Any]:
        pytest.importorskip("transformers")
        from tests.support import hf_models

        torch.manual_seed(0)
        model, batch = getattr(hf_models, name)()
        return model, (batch,), lambda out: out.loss

    return built


_PAD = torch.ones(2, 64, dtype=torch.bool)
_PAD[1, 50:] = False


CASES: dict[str, Case] = {
    "gpt": _gpt,
    "resnet": _case(
        lambda: ResNet((4, 8, 16, 32)), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ),
    "vit": _case(F.ViT, torch.randn(2, 3, 16, 16), loss=F.class_loss),
    "gru": _case(F.GRUModel, F.tokens(100, shape=(2, 16)), loss=F.token_loss),
    "towers": _case(F.Towers, torch.randn(2, 32), torch.randn(2, 32)),
    "autocast-inside": _case(F.AutocastMLP, torch.randn(2, 32)),
    "tanh-ends": _case(lambda: nn.Sequential(*[F.TanhBlock() for _ in range(4)]), torch.randn(2, 16)),
    "mobilenet": _case(F.MobileNet, torch.randn(2, 3, 16, 16), loss=F.class_loss),
    # a mask and rotary tables every block receives (kept blocks save the tables): where they
    # live with every block kept is read in one forward whose saved tensors are dropped
    "rotary-mask": _case(F.RotaryLM, F.tokens(shape=(2, 64)), _PAD, loss=F.token_loss),
    "hf-llama": _hf("llama"),
    # T5's shape: each stack's first block makes a bias the others receive and return; with
    # every block kept the encoder's dies as the encoder returns (a window of the forward)
    "encoder-decoder-bias": _case(F.EncoderDecoder, torch.randn(2, 64, 32)),
}
SLOW_CASES: dict[str, Case] = {
    "unet": _case(F.UNet, torch.randn(2, 3, 32, 32)),
    "moe": _case(lambda: F.TokenLM(F.MoEBlock), F.tokens(shape=(2, 16)), loss=F.token_loss),
    "sdpa-dropout": _case(lambda: F.TokenLM(F.SDPABlock), F.tokens(shape=(2, 32)), loss=F.token_loss),
    "tuple": _case(
        lambda: nn.Sequential(*[F.TupleBlock() for _ in range(4)]), (torch.randn(2, 32), torch.randn(2, 32))
    ),
    "nested-checkpoint": _case(
        lambda: nn.Sequential(*[F.NestedCkptBlock() for _ in range(4)]), torch.randn(2, 32)
    ),
    "vgg-inplace-relu-blocks": _case(F.vgg, torch.randn(2, 3, 32, 32), loss=F.class_loss),
    "hf-bert": _hf("bert"),
    "hf-gpt2": _hf("gpt2"),
    "hf-bart": _hf("bart"),
    "hf-neox": _hf("neox"),
    "hf-mixtral": _hf("mixtral"),
}


def _profile(make: Case, paired: bool, optimizer: bool = False) -> dict[str, Any]:
    model, args, loss = make()
    if isinstance(args[0], dict):  # a Hugging Face batch: keyword arguments
        inputs = Inputs(**args[0])
    else:
        inputs = Inputs(*args)
    opt = torch.optim.AdamW(model.parameters()) if optimizer else None
    loop = Loop(optimizer=opt, loss_fn=loss, timer="flops")
    prof = measure.profile_loop(model, inputs, loop, paired=paired)
    return json.loads(prof.to_json())


def _check_equal(make: Case, optimizer: bool = False) -> None:
    uniform, paired = _profile(make, False, optimizer), _profile(make, True, optimizer)
    # a profile from pair steps measures no scratch (measured under the plan, as for one
    # from shapes: ``from_shapes``); every other field is the uniform steps' to the byte
    assert paired["from_shapes"] is True
    diff = measured_differences(uniform, paired)
    assert not diff, diff[:10]


@pytest.mark.parametrize("name", list(CASES))
def test_pair_steps_give_the_uniform_steps_byte_terms(name):
    _check_equal(CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_pair_steps_give_the_uniform_steps_byte_terms_on_more_families(name):
    _check_equal(SLOW_CASES[name])


#: Inside the loop's autocast region (forward and loss in it, backward after its end: the
#: region ends after the model returns, so pair steps record the ``top`` window's parts
#: before the return, between it and the region's end, and after it).
AMP_CASES = ["gpt", "rotary-mask", "encoder-decoder-bias", "resnet", "towers"]


@pytest.mark.parametrize("name", AMP_CASES)
def test_pair_steps_inside_the_loops_autocast_region_give_the_uniform_byte_terms(name):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _check_equal(CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unet", "tuple", "vgg-inplace-relu-blocks", "hf-gpt2", "hf-bart"])
def test_pair_steps_inside_the_loops_autocast_region_on_more_families(name):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _check_equal(SLOW_CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "neox", "mixtral", "t5", "bert"])
def test_hugging_face_llms_inside_the_loops_autocast_region_are_never_below_the_uniform_steps(
    name,
):
    # a tensor the blocks receive that dies in the last window before the model returns
    # (512 B on Llama, NeoX, Mixtral; T5's bias; BERT's embedding output, which its
    # BertModel holds until it returns and block 0 saves only as bf16 casts) is held on by
    # the pair steps' recomputed blocks: high there by at most its bytes, equal elsewhere
    with torch.autocast("cpu", dtype=torch.bfloat16):
        uniform, paired = _profile(_hf(name), False), _profile(_hf(name), True)
    diff = measured_differences(uniform, paired)
    last = len(uniform["blocks"]) - 1
    allowed = {".top", f".blocks[{last}].pre_exit.keep", f".blocks[{last}].bwd_excess.keep"}
    assert {d[0] for d in diff} <= allowed, diff
    assert all(0 <= b - a <= 49152 for _, a, b in diff), diff


def test_pair_steps_give_the_uniform_optimizer_terms():
    _check_equal(_gpt, optimizer=True)


def test_no_pair_step_holds_more_than_its_patterns_predicted_peak():
    model, (x,), _ = _gpt()
    uniform = measure.profile_loop(model, Inputs(x), Loop(timer="flops"))
    n = len(uniform.blocks)

    def bound(single: bool) -> int:
        return max(
            uniform.peak([d.value for d in pattern]).bytes
            for d in (Decision.KEEP, Decision.SELECTIVE, Decision.SPLIT)
            for pattern in pair_patterns(n, d, {}, single)
        )

    static = sum(p.nbytes for p in model.parameters()) + x.nbytes
    with remat.memory.track() as t:
        prof = measure.profile_loop(model, Inputs(x), Loop(timer="flops"), paired=True)
    held = static + t.peak_bytes_by_device["cpu"]
    # the GPT's blocks save nothing the next block receives: one block at a time
    assert prof.steps == "singles"
    # the profile's own records (weak references, a few small tensors) on top: 2 KiB here
    assert held <= bound(single=True) + 4096
    assert held < bound(single=False) < uniform.unchecked_peak_bytes


@pytest.mark.parametrize(
    ("name", "steps"),
    [
        ("gpt", "singles"),
        ("rotary-mask", "singles"),  # a mask and tables every block receives: none saves it first
        ("resnet", "pairs"),  # a block's last ReLU saves its output, the next block's input
    ],
)
def test_single_steps_where_no_block_saves_what_the_next_receives(name, steps):
    assert _profile(CASES[name], True)["steps"] == steps


def test_pair_steps_inside_the_loops_autocast_region():
    # under autocast a block saves casts of what it receives: the pair effects differ
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _profile(CASES["gpt"], True)["steps"] == "pairs"


def test_hugging_face_t5_from_pair_steps_is_never_below_the_uniform_steps():
    # the decoder's bias dies as the decoder stack returns, inside the model's forward but
    # before its head and loss: the pair steps, whose recomputed blocks hold it, count it in
    # the last window (up to the model's return) where the uniform step has it dead: high
    # there by at most its bytes, equal everywhere else
    uniform, paired = _profile(_hf("t5"), False), _profile(_hf("t5"), True)
    diff = measured_differences(uniform, paired)
    assert {d[0] for d in diff} <= {".top", ".blocks[7].bwd_excess.keep"}, diff
    assert all(0 <= b - a <= 49152 for _, a, b in diff), diff


class _Routed(nn.Module):
    """A block whose work depends on its input's values (as a mixture of experts' routing):
    shapes alone cannot profile it."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        pick = int((x.sum() > 0).item())
        h = (self.a if pick else self.b)(x)
        return x + self.out(torch.relu(h if bias is None else h + bias))


def _routed() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(*[_Routed() for _ in range(8)]), torch.randn(2, 512, 64, requires_grad=True)


@pytest.mark.parametrize("budget", ["70%", "50%"])
def test_a_batch_too_small_to_fit_is_profiled_from_pair_steps_never_the_unchecked_step(
    budget, capsys
):
    model, x = _routed()
    unchecked = remat.measure_peak(model, x)
    static = sum(p.nbytes for p in model.parameters()) + x.nbytes
    with remat.memory.track() as t:  # every tensor any step inside allocates
        p = remat.auto_checkpoint(model, x, budget=budget, timer="flops")
    err = capsys.readouterr().err
    held = static + t.peak_bytes_by_device["cpu"]
    assert "one or two blocks kept at a time (never the unchecked step)" in err
    assert "the unchecked step among them" not in err
    assert held < unchecked
    assert remat.measure_peak(model, x) <= p.budget_bytes
    if budget == "70%":  # the pair steps fit: no step held more than the budget
        assert held <= p.budget_bytes
        assert "above the budget" not in err
    else:  # 50 %: below what a block kept at a time holds, which is said
        assert held > p.budget_bytes
        assert "the single steps held up to" in err  # the routed blocks: one at a time


def test_sizes_of_a_model_shapes_cannot_profile_are_profiled_from_pair_steps(capsys):
    # remat.Shapes on a model that reads values (shapes alone cannot profile it), batch 2: each
    # size is profiled from pair steps (the largest first: its profile gives the budget),
    # never an unchecked step; each size's byte terms are its uniform steps'; every size's
    # measured peak within the budget, and no profiling step held more than the budget
    from remat.planner.shapes import Shapes, shape_plans

    model, x = _routed()
    shapes = Shapes(dims=1, multiple=64)
    plans = shape_plans(model, Inputs(x), shapes, "70%", Loop(timer="flops"), quiet=True)
    for n, got in plans.fit.profiles.items():
        a, _ = shapes.cut(((x,), {}), 512, n)
        uniform = measure.profile_loop(model, Inputs(*a), Loop(timer="flops"))
        diff = measured_differences(json.loads(uniform.to_json()), json.loads(got.to_json()))
        assert got.from_shapes and not diff, (n, diff[:5])
    model, x = _routed()
    unchecked = remat.measure_peak(model, x)
    static = sum(p.nbytes for p in model.parameters()) + x.nbytes
    with remat.memory.track() as t:
        shaped = remat.auto_checkpoint(model, x, budget="70%", timer="flops", shapes=shapes)
    err = capsys.readouterr().err
    held = static + t.peak_bytes_by_device["cpu"]
    # the three sizes, and one between them that checks the fit
    assert err.count("one or two blocks kept at a time (never the unchecked step)") == 4, err
    assert "the unchecked step among them" not in err
    assert held <= shaped.budget_bytes < unchecked
    for n in plans.fit.profiles:
        a, _ = shapes.cut(((x,), {}), 512, n)
        assert remat.measure_peak(model, *a) <= shaped.budget_bytes
    shaped.remove()


def test_remat_profile_paired_gives_the_uniform_byte_terms_and_never_holds_the_unchecked_step():
    model, (x,), _ = _gpt()
    uniform = remat.profile(model, x, timer="flops")
    static = sum(p.nbytes for p in model.parameters()) + x.nbytes
    with remat.memory.track() as t:
        paired = remat.profile(model, x, timer="flops", paired=True)
    assert static + t.peak_bytes_by_device["cpu"] < uniform.unchecked_peak_bytes
    assert paired.from_shapes
    diff = measured_differences(json.loads(uniform.to_json()), json.loads(paired.to_json()))
    assert not diff, diff[:5]
    # the same plans for the same budgets in bytes (the uniform profile's scratch left out)
    bare = located(uniform, None)
    for share in (0.7, 0.5, 0.3):
        b = int(uniform.floor_bytes + share * (uniform.unchecked_peak_bytes - uniform.floor_bytes))
        assert remat.plan(paired, b).decisions == remat.plan(bare, b).decisions


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"paired": "yes"}, "paired must be True or False, got 'yes'"),
        ({"paired": True, "compile": True}, "paired=True is for a real model's eager steps"),
    ],
)
def test_remat_profile_paired_refuses_what_it_cannot_pair(kwargs, match):
    model, (x,), _ = _gpt()
    with pytest.raises((TypeError, ValueError), match=match):
        remat.profile(model, x, timer="flops", **kwargs)


def test_remat_profile_paired_refuses_a_model_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="got a model on the meta device .*leave paired out"):
        remat.profile(model, torch.empty(4, 8, device="meta"), timer="flops", paired=True)


def test_remat_profile_paired_says_why_a_model_cannot_be_paired():
    torch.manual_seed(0)
    model = _Shared()
    with pytest.raises(ValueError, match="pair steps cannot profile this model .*leave paired out"):
        remat.profile(model, torch.randn(2, 16, 32, requires_grad=True), timer="flops", paired=True)


class _Shared(nn.Module):
    """Routed blocks that each receive a bias the model makes, in an autocast region that
    ends inside the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Routed(32) for _ in range(3))
        self.table = nn.Parameter(torch.zeros(128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bias = self.table * 2.0
            for b in self.blocks:
                x = b(x, bias)
            return x.float()


def test_a_small_batch_of_a_model_pair_steps_cannot_profile_falls_back_and_says_why(capsys):
    torch.manual_seed(0)
    model = _Shared()
    x = torch.randn(2, 16, 32, requires_grad=True)
    p = remat.auto_checkpoint(model, x, budget="100%", timer="flops")
    err = capsys.readouterr().err
    assert "pair steps cannot profile this model: an autocast region ends inside the model" in err
    assert "the unchecked step among them" in err
    assert remat.measure_peak(model, x) <= p.budget_bytes


def scenario_ranks(rank: int) -> dict[str, list[tuple[str, Any, Any]]]:
    # each rank its own batch; DDP in its modes (static_graph's early steps differ: the pair
    # profile runs as many unmeasured steps first as the uniform one)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.planner.test_distributed_ranks import DDP_MODES, SMALL_GPT

    x = example_input(SMALL_GPT, seed=1 + rank)
    makers: dict[str, Callable[[], nn.Module]] = {
        f"ddp-{mode}": (lambda kw=kw: DDP(build(SMALL_GPT), **kw)) for mode, kw in DDP_MODES.items()
    }
    # FSDP2 is left out: its gathers and frees run on gloo's threads, and in one of three or
    # four runs a block's gathered parameters landed on the other side of a window's edge
    # (the last window, or a split block's): equal otherwise (CHANGELOG)
    out = {}
    for name, make in [*makers.items(), ("ddp-plain-amp", makers["ddp-plain"])]:
        seen = []
        amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=name.endswith("-amp"))
        for paired in (False, True):
            torch.manual_seed(0)
            with amp:  # the loop's mixed-precision region, the usual recipe under DDP
                prof = measure.profile_loop(
                    make(), Inputs(x), Loop(timer="flops"), paired=paired
                )
            seen.append(json.loads(prof.to_json()))
        out[name] = measured_differences(*seen)
    return out


SCENARIOS = {"ranks": scenario_ranks}


@pytest.mark.slow
def test_pair_steps_of_ddp_ranks_give_the_uniform_steps_byte_terms(tmp_path):
    from tests.support.ranks import run_ranks

    for rank, result in enumerate(run_ranks(tmp_path, __name__, "ranks", 2, 300)):
        for name, diff in result.items():
            assert not diff, (rank, name, diff[:10])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
