"""remat.integrations.lightning.RematCallback through a real Lightning Trainer.fit().

Each case fits a small residual MLP for a few steps three times from the same seed:
without remat, with the callback and a gradient recorder (measure=False: the recorder's
copies would be part of the measured batch), and with the callback measuring. Losses,
gradients and parameters must be bitwise those of the run without remat, and every
measured batch within the budget.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

L = pytest.importorskip("lightning")
from remat.integrations.lightning import RematCallback  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # Lightning's own advice (dataloader workers, no logger, ...), not about remat
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]

STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 128), nn.GELU(), nn.Linear(128, d))

    def forward(self, x):
        return x + self.mlp(x)


class Net(L.LightningModule):
    def __init__(self, record: bool = False, manual: bool = False) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(4)])
        self.head = nn.Linear(32, 1)
        self.record = record
        self.automatic_optimization = not manual
        self.grads: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.blocks(x)).float(), y)
        self.log("train_loss", loss)
        return {"loss": loss}

    def on_before_optimizer_step(self, optimizer):
        if self.record:
            self.grads.append({n: p.grad.clone() for n, p in self.named_parameters()})

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(callbacks, *, accumulation=1, precision="32-true", record=False, manual=False):
    torch.manual_seed(0)
    net = Net(record=record, manual=manual)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(96, 32, generator=g), torch.randn(96, 1, generator=g)
    )
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulation,
        precision=precision,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        trainer.fit(net, torch.utils.data.DataLoader(data, batch_size=16))
    return trainer, net


@pytest.mark.parametrize(
    "accumulation,precision",
    [
        (1, "32-true"),  # the previous step's gradients alive during forward
        (2, "32-true"),  # two batches per optimizer step
        (2, "bf16-mixed"),  # and the precision plugin's bfloat16 autocast
    ],
)
def test_fit_with_callback_trains_as_without_and_within_the_budget(accumulation, precision):
    _, plain = fit([], accumulation=accumulation, precision=precision, record=True)

    cb = RematCallback("50%", timer="flops", measure=False)
    _, recorded = fit([cb], accumulation=accumulation, precision=precision, record=True)
    assert any(d != "keep" for d in cb.plan.decisions.values())
    assert recorded.losses == plain.losses and len(plain.losses) == STEPS * accumulation
    assert len(recorded.grads) == len(plain.grads) == STEPS
    for got, want in zip(recorded.grads, plain.grads):
        assert all(torch.equal(got[k], want[k]) for k in want)
    want_params = dict(plain.named_parameters())
    assert all(torch.equal(p, want_params[n]) for n, p in recorded.named_parameters())
    # the planner's steps ran training_step but logged nothing and changed no result
    assert recorded.steps_run > plain.steps_run

    measuring = RematCallback("50%", timer="flops")
    trainer, measured = fit([measuring], accumulation=accumulation, precision=precision)
    assert measured.losses == plain.losses
    checks = measuring.checks
    assert len(checks) == STEPS * accumulation
    plan = measuring.plan
    for c in checks:
        assert c.peak_bytes <= c.budget_bytes == plan.budget_bytes
        assert c.predicted_bytes == plan.predicted_peak_bytes
    logged = trainer.logged_metrics
    assert logged["remat/peak_bytes"].item() == checks[-1].peak_bytes
    assert logged["remat/budget_bytes"].item() == plan.budget_bytes
    assert _get_current_dispatch_mode_stack() == []
    assert "log" not in measured.__dict__ and "log_dict" not in measured.__dict__


def test_plan_names_are_the_modules_blocks(capsys):
    cb = RematCallback("50%", timer="flops", measure=False)
    fit([cb])
    assert list(cb.plan.decisions) == [f"module.blocks.{i}" for i in range(4)]
    assert cb.plan.breakdown["optimizer"] > 0  # AdamW's state is in the planned step
    err = capsys.readouterr().err  # planning said each stage
    assert "remat.auto_checkpoint: profiling" in err and "planned, measured peak" in err


def test_check_fn_picks_blocks_by_the_modules_own_names():
    seen = []

    def pick(name, module):
        seen.append(name)
        return name in ("blocks.1", "blocks.2")

    cb = RematCallback("90%", timer="flops", check_fn=pick, measure=False)
    fit([cb])
    assert list(cb.plan.decisions) == ["module.blocks.1", "module.blocks.2"]
    assert "blocks.0" in seen and not any(n.startswith("module.") for n in seen)


def test_manual_optimization_is_refused_with_advice():
    cb = RematCallback("50%", timer="flops")
    with pytest.raises(ValueError, match="manual optimization"):
        fit([cb], manual=True)
    assert _get_current_dispatch_mode_stack() == []


def test_callback_refuses_a_bad_option_when_made_not_on_the_first_batch():
    with pytest.raises(ValueError, match="budget='50' is a bare number"):
        RematCallback("50")
    with pytest.raises(ValueError, match="timer must be one of"):
        RematCallback("50%", timer="flop")
    with pytest.raises(TypeError, match="check_fn must be callable"):
        RematCallback("50%", check_fn="layers")


def test_callback_refuses_a_compile_that_is_not_a_bool():
    with pytest.raises(TypeError, match="compile must be True or False"):
        RematCallback("50%", compile="yes")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_fit_with_a_compiled_plan_compiles_the_blocks_and_trains_as_without():
    from remat.planner.regional import compiled_level

    _, plain = fit([], record=True)
    cb = RematCallback("70%", compile=True)
    _, net = fit([cb], record=True)
    assert cb.plan.compiled and cb.checks == []  # compiled steps are not metered
    assert all(compiled_level(b) is not None for b in net.blocks)
    # compiled kernels round differently from eager ones: close, not bitwise
    for got, want in zip(net.grads, plain.grads):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)
    assert _get_current_dispatch_mode_stack() == []
