"""remat.verify: finds planted differences, reports none on a correct model, leaves no trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import remat


class Blocks(torch.nn.Module):
    def __init__(self, drift=False, n=3, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.norm = torch.nn.BatchNorm1d(d)
        self.drift = drift
        self.calls = 0

    def block(self, layer, x):
        self.calls += 1
        scale = self.calls if self.drift else 1  # planted: recompute sees another value
        return F.dropout(F.gelu(layer(x)) * scale, 0.1, training=True)

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = x + remat.checkpoint(self.block, layer, x)
        return x


def test_verify_reports_nothing_on_a_correct_model():
    report = remat.verify(Blocks(), torch.randn(8, 16))
    assert report.ok, str(report)
    assert report.compared == 2 * 3 + 2 + 3 + 1  # grads, buffers, loss
    assert report.loss_checkpointed == report.loss_plain
    assert report.peak_bytes_checkpointed < report.peak_bytes_plain
    assert "OK" in str(report)


def test_verify_finds_a_planted_recompute_difference():
    report = remat.verify(Blocks(drift=True), torch.randn(8, 16))
    assert not report.ok
    kinds = {d.kind for d in report.differences}
    assert "grad" in kinds
    names = {d.name for d in report.differences}
    assert "layers.0.weight" in names
    assert all(d.max_abs > 0 for d in report.differences)
    assert "DIFFERENCES FOUND" in str(report) and "layers.0.weight" in str(report)


def test_verify_leaves_grads_buffers_and_rng_as_they_were():
    model = Blocks()
    x = torch.randn(8, 16)
    model(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    remat.verify(model, x)
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n])
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n])


def test_verify_uses_loss_fn_and_kwargs():
    class KW(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, *, shift):
            return {"out": remat.checkpoint(self.lin, x) + shift, "aux": 3}

    report = remat.verify(
        KW(), torch.randn(2, 4), shift=1.0, loss_fn=lambda o: o["out"].square().mean()
    )
    assert report.ok


def test_verify_without_a_differentiable_output_says_to_pass_loss_fn():
    class NoGrad(torch.nn.Module):
        def forward(self, x):
            return x.argmax()

    with pytest.raises(ValueError, match="loss_fn"):
        remat.verify(NoGrad(), torch.randn(3))


def test_verify_compares_and_restores_input_gradients():
    x = torch.randn(8, 16, requires_grad=True)
    x.grad = torch.full_like(x, 7.0)
    before = x.grad
    report = remat.verify(Blocks(drift=True), x)
    assert "input[0]" in {d.name for d in report.differences}
    assert x.grad is before and torch.equal(x.grad, torch.full_like(x, 7.0))
    assert remat.verify(Blocks(), x).ok


def test_verify_puts_back_a_buffer_the_forward_replaced():
    class Replaces(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps = self.steps + 1  # a new tensor object each call
            return remat.checkpoint(self.lin, x)

    model = Replaces()
    original = model.steps
    report = remat.verify(model, torch.randn(2, 4))
    assert report.ok, str(report)
    assert model.steps is original and model.steps.item() == 0.0


# ---------------------------------------------------------------- NaNs, inputs, statistics


class _Log(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return remat.checkpoint(self.lin, x).log()


def test_verify_treats_nans_at_the_same_places_as_equal():
    # the loss and the input gradient are NaN in both runs, bit for bit: "loss differs, nan"
    x = torch.full((2, 4), -100.0, requires_grad=True)
    report = remat.verify(_Log(), x, loss_fn=lambda o: o.sum() * x.sum())
    assert report.ok, str(report)


def test_verify_reports_a_nan_on_one_side_only_as_infinite():
    from remat.measure.verify import _diff

    a = torch.tensor([1.0, float("nan")])
    assert _diff(a, a.clone()) is None
    assert _diff(a, torch.tensor([1.0, 2.0])) == float("inf")
    assert _diff(a, torch.tensor([3.0, float("nan")])) == 2.0


def test_verify_detaches_an_input_that_is_not_a_leaf():
    # the second step's backward ran into the input's graph, freed by the first: it raised
    w = torch.randn(2, 4, requires_grad=True)
    report = remat.verify(_Log(), (w * 2).exp())
    assert report.ok, str(report)
    assert "input[0]" not in {d.name for d in report.differences}
    assert w.grad is None  # the graph that made the input is not run


def test_verify_leaves_no_gradient_on_a_parameter_of_the_loss():
    # a leaf reached only through loss_fn got its gradient accumulated twice
    scale = torch.nn.Parameter(torch.ones(()))
    remat.verify(_Log(), torch.rand(2, 4) + 1, loss_fn=lambda o: (o * scale).sum())
    assert scale.grad is None


def test_verify_reports_batchnorm_statistics_updated_again_by_the_recompute():
    # not a bug of verify: BatchNorm inside a checkpoint updates its statistics twice
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return remat.checkpoint(self.bn, x)

    model = M()
    report = remat.verify(model, torch.randn(8, 4, requires_grad=True))
    assert {d.name for d in report.differences} == {
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    }
    assert model.bn.num_batches_tracked.item() == 0  # restored


def test_verify_without_checkpointing_reports_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    assert remat.verify(model, torch.randn(3, 4)).ok


def test_verify_prints_the_step_peak_a_budget_counts_and_says_what_it_counts():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    remat.apply_activation_checkpointing(model)
    x = torch.randn(8, 16)
    report = remat.verify(model, x)
    # the checkpointed step's peak is measure_peak's (no optimizer): one convention
    assert report.step_peak_checkpointed == remat.measure_peak(model, x)
    assert report.step_peak_checkpointed == report.static_bytes + report.peak_bytes_checkpointed
    text = str(report)
    assert "step peak   checkpointed" in text
    assert "parameters, buffers and inputs" in text and "remat.measure_peak" in text
