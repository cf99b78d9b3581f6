"""What remat needs to know about a user's model (remat.modules.modelinfo): its repeated blocks, a
loss from its output, its device, and buffer values put back after steps that are not the
user's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from remat.modules.modelinfo import (
    BufferSnapshot,
    candidates,
    check_grad_enabled,
    check_module,
    counted_device,
    default_blocks,
    default_loss,
    device_of,
    loss_of,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Sequential(nn.ReLU(), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class Model(nn.Module):
    """A long stem of mixed layers (seven children, three of one class) and four blocks."""

    def __init__(self) -> None:
        super().__init__()
        L, R = nn.Linear, nn.ReLU
        self.stem = nn.Sequential(L(4, 4), R(), L(4, 4), R(), L(4, 4), R(), nn.Dropout(0.1))
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------- blocks


def test_default_blocks_are_a_containers_repeated_children_not_a_longer_mixed_stem():
    assert default_blocks(Model()) == [f"layers.{i}" for i in range(4)]


def test_default_blocks_tie_goes_to_the_container_all_of_one_class():
    model = nn.Module()
    model.mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU())
    model.same = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    assert default_blocks(model) == ["same.0", "same.1", "same.2"]


def test_a_model_without_containers_has_no_default_blocks_and_candidates_say_what_to_pass():
    model = nn.Linear(2, 2)
    assert default_blocks(model) == []
    with pytest.raises(ValueError, match=r"remat\.x: found no candidate blocks.*check_fn="):
        candidates(model, None, where="remat.x")


def test_candidates_with_check_fn_are_the_outermost_modules_it_selects():
    picked = candidates(Model(), lambda name, m: isinstance(m, nn.Sequential))
    # the stem and each block's activation Sequential; not the children of a selected module
    assert picked == ["stem"] + [f"layers.{i}.act" for i in range(4)]
    nested = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(2, 2))))
    assert candidates(nested, lambda name, m: isinstance(m, nn.Sequential)) == ["0"]


def test_check_module_names_the_function_the_argument_and_the_type():
    check_module(nn.Linear(2, 2), "remat.x")
    with pytest.raises(TypeError, match=r"remat\.x: net must be a torch\.nn\.Module, got function"):
        check_module(lambda t: t, "remat.x", arg="net")


# ---------------------------------------------------------------- the loss


@dataclasses.dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


def test_default_loss_is_the_loss_the_output_holds():
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    logits = w * 3
    assert default_loss({"loss": loss, "logits": logits}) is loss  # a mapping entry
    assert default_loss(Output(loss, logits)) is loss  # an attribute


def test_without_a_loss_it_is_the_float32_sum_of_the_floating_outputs_that_require_grad():
    w = torch.ones(3, requires_grad=True)
    half = (w * 3).to(torch.bfloat16)
    out = Output(None, half), [w * 2, torch.arange(3), (w * 5).detach()]
    got = default_loss(out)
    assert got.dtype == torch.float32
    assert torch.equal(got, half.float().sum() + (w * 2).sum())
    # a "loss" that does not require grad is not the step's loss either
    assert torch.equal(default_loss(Output((w * 7).sum().detach(), half)), half.float().sum())


def test_an_output_without_a_differentiable_tensor_says_to_pass_loss_fn():
    with pytest.raises(ValueError, match=r"remat\.x: .*no floating tensor.*Pass loss_fn="):
        default_loss((torch.ones(2), torch.arange(2)), where="remat.x")


def test_loss_of_uses_the_given_loss_fn():
    w = torch.ones(2, requires_grad=True)
    out = {"loss": (w * 2).sum(), "logits": w}
    assert torch.equal(loss_of(out, lambda o: o["logits"].square().sum(), "remat.x"), w.sum())


def test_check_grad_enabled_raises_under_no_grad_naming_the_caller():
    check_grad_enabled("remat.x")
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"remat\.x was called with gradients"):
        check_grad_enabled("remat.x")


# ---------------------------------------------------------------- device


def test_device_is_the_first_tensor_argument_then_the_first_parameter_then_cpu():
    on_meta = nn.Linear(2, 2, device="meta")
    assert device_of(nn.Linear(2, 2), ({"x": torch.empty(2, device="meta")},)).type == "meta"
    assert device_of(on_meta, (3, "text")).type == "meta"
    assert device_of(nn.ReLU(), ()) == torch.device("cpu")


def test_every_device_counts_on_cpu_and_only_the_models_device_elsewhere():
    assert counted_device(torch.device("cpu")) is None
    assert counted_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


# ---------------------------------------------------------------- buffers


def test_buffer_snapshot_puts_back_running_statistics_and_a_replaced_buffer():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bn = model[1]
    mean, count = bn.running_mean, bn.num_batches_tracked
    before = (mean.clone(), count.clone())
    snap = BufferSnapshot(model)
    model(torch.randn(8, 4)).sum().backward()  # a training step updates the statistics
    bn.running_var = torch.full((4,), 9.0)  # and a step may replace a buffer
    assert not torch.equal(mean, before[0]) and int(count) == 1
    snap.restore()
    assert bn.running_mean is mean and bn.num_batches_tracked is count
    assert torch.equal(mean, before[0]) and torch.equal(count, before[1])
    assert torch.equal(bn.running_var, torch.ones(4))  # the original buffer, value as it was
