"""remat.integrations.hf.RematCallback through a real transformers Trainer.train().

Each case trains a tiny random Llama for a few steps three times from the same seed:
without remat, with the callback and a gradient recorder (measure=False: the recorder's
copies would be part of the measured step), and with the callback measuring. Losses,
gradients and parameters must be bitwise those of the run without remat, and every
measured step within the budget.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from remat.integrations import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3


class GradRecorder(transformers.TrainerCallback):
    """The gradients each optimizer step applies."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters()})


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def make_data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(24):
        ids = torch.randint(0, 64, (32,), generator=g)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def train(tmp_path, callbacks, *, accumulation=1, bf16=False, **extra):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        bf16=bf16,
        **extra,
    )
    model = make_model()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=make_data(), callbacks=callbacks
    )
    trainer.train()
    return trainer, model


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(autouse=True)
def quiet_transformers():
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.mark.parametrize(
    "accumulation,bf16",
    [
        (1, False),  # gradients freed after each step: set_to_none=True
        # two micro-batches per step: gradients kept between them (slow: 5 s)
        pytest.param(2, False, marks=pytest.mark.slow),
        # and accelerate's bfloat16 autocast around the model's forward (slow: 12 s)
        pytest.param(2, True, marks=pytest.mark.slow),
    ],
)
def test_trainer_with_callback_trains_as_without_and_within_the_budget(
    tmp_path, accumulation, bf16
):
    plain_rec = GradRecorder()
    plain, plain_model = train(tmp_path, [plain_rec], accumulation=accumulation, bf16=bf16)

    rec = GradRecorder()
    cb = hf.RematCallback("50%", timer="flops", measure=False)
    recorded, recorded_model = train(tmp_path, [rec, cb], accumulation=accumulation, bf16=bf16)
    assert any(d != "keep" for d in cb.plan.decisions.values())
    assert losses(recorded) == losses(plain) and len(losses(plain)) == STEPS
    assert len(rec.grads) == len(plain_rec.grads) == STEPS
    for got, want in zip(rec.grads, plain_rec.grads):
        assert all(torch.equal(got[k], want[k]) for k in want)
    want_params = dict(plain_model.named_parameters())
    assert all(torch.equal(p, want_params[n]) for n, p in recorded_model.named_parameters())

    measuring = hf.RematCallback("50%", timer="flops")
    measured, _ = train(tmp_path, [measuring], accumulation=accumulation, bf16=bf16)
    assert losses(measured) == losses(plain)
    checks = measuring.checks
    assert [c.step for c in checks] == list(range(1, STEPS + 1))
    plan = measuring.plan
    for c in checks:
        assert c.peak_bytes <= c.budget_bytes == plan.budget_bytes
        assert c.predicted_bytes == plan.predicted_peak_bytes
    logged = [h for h in measured.state.log_history if "loss" in h]
    assert [h["remat/peak_bytes"] for h in logged] == [c.peak_bytes for c in checks]
    assert all(h["remat/budget_bytes"] == plan.budget_bytes for h in logged)
    assert _get_current_dispatch_mode_stack() == []


def test_plan_is_made_once_with_the_trainers_optimizer(tmp_path, capsys):
    cb = hf.RematCallback("60%", timer="flops")
    train(tmp_path, [cb])
    assert cb.plan.breakdown["optimizer"] > 0  # AdamW's state is in the planned step
    err = capsys.readouterr().err  # planning said each stage
    assert "remat.auto_checkpoint: profiling" in err and "planned, measured peak" in err
    first = cb.plan
    # the first step creates the optimizer state, later ones start with it
    assert cb.checks[0].peak_bytes < cb.checks[1].peak_bytes
    assert cb.plan is first


@pytest.mark.parametrize(
    "switch",
    [
        {"activation_checkpointing": True},  # transformers 5's name
        {"gradient_checkpointing": True},  # its deprecated alias (a FutureWarning)
    ],
)
def test_transformers_own_checkpointing_is_taken_over_and_trains_as_without(
    tmp_path, caplog, switch
):
    plain_rec = GradRecorder()
    plain, plain_model = train(tmp_path, [plain_rec])
    rec = GradRecorder()
    cb = hf.RematCallback("50%", timer="flops", measure=False)
    with caplog.at_level(logging.WARNING, logger="remat"):
        if "gradient_checkpointing" in switch:
            with pytest.warns(FutureWarning, match="activation_checkpointing"):
                trainer, model = train(tmp_path, [rec, cb], **switch)
        else:
            trainer, model = train(tmp_path, [rec, cb], **switch)
    assert trainer.args.activation_checkpointing  # it was on ...
    assert not model.is_activation_checkpointing  # ... and remat turned it off
    said = [r.getMessage() for r in caplog.records if "turned it off" in r.getMessage()]
    assert len(said) == 1  # once
    assert "activation_checkpointing_disable()" in said[0]
    assert "plans the 4 layers" in said[0]
    assert any(d != "keep" for d in cb.plan.decisions.values())  # remat planned the layers
    assert losses(trainer) == losses(plain)
    for got, want in zip(rec.grads, plain_rec.grads, strict=True):
        assert all(torch.equal(got[k], want[k]) for k in want)
    want_params = dict(plain_model.named_parameters())
    assert all(torch.equal(p, want_params[n]) for n, p in model.named_parameters())
    assert _get_current_dispatch_mode_stack() == []


def test_callback_refuses_a_bad_option_when_made_not_on_the_first_batch():
    with pytest.raises(ValueError, match="budget='50' is a bare number"):
        hf.RematCallback("50")
    with pytest.raises(ValueError, match="timer must be one of"):
        hf.RematCallback("50%", timer="flop")
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        hf.RematCallback("50%", loss_fn="ce")
    with pytest.raises(TypeError, match="measure must be True or False"):
        hf.RematCallback("50%", measure="no")


@pytest.mark.parametrize("budget", [None, [1], True])
def test_callback_rejects_a_budget_of_the_wrong_type(budget):
    with pytest.raises(TypeError, match="budget must be bytes"):
        hf.RematCallback(budget)


def test_callback_refuses_a_compile_that_is_not_a_bool():
    with pytest.raises(TypeError, match="compile must be True or False"):
        hf.RematCallback("50%", compile=1)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_trainer_with_a_compiled_plan_compiles_the_layers_and_trains_close_to_without(tmp_path):
    from remat.planner.regional import compiled_level

    plain_rec = GradRecorder()
    plain, _ = train(tmp_path, [plain_rec])
    rec = GradRecorder()
    cb = hf.RematCallback("70%", compile=True)
    trained, model = train(tmp_path, [rec, cb])
    assert cb.plan.compiled and cb.checks == []  # compiled steps are not metered
    assert all(compiled_level(model.get_submodule(n)) is not None for n in cb.plan.decisions)
    # compiled kernels round differently from eager ones: close, not bitwise
    assert losses(trained) == pytest.approx(losses(plain), rel=1e-4)
    for got, want in zip(rec.grads, plain_rec.grads):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-6)
    assert _get_current_dispatch_mode_stack() == []
