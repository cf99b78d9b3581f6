"""remat.integrations.hf's model switch: every stack's layers, the cache, a clean undo.

Tiny random configs only (nothing is downloaded).
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys

import pytest
import torch

import remat

transformers = pytest.importorskip("transformers")
from remat.integrations import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def llama(layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).train()


def bart() -> torch.nn.Module:
    """Encoder and decoder stacks, dropout on (replayed in recompute)."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        dropout=0.1,
    )
    return transformers.BartForConditionalGeneration(config).train()


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def grads_of(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(123)
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_step(a: torch.nn.Module, b: torch.nn.Module, inputs: dict) -> None:
    loss_a, grads_a = grads_of(a, inputs)
    loss_b, grads_b = grads_of(b, inputs)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def hooks_and_wraps(model: torch.nn.Module) -> tuple[int, list[str]]:
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    wrapped = [n for n, m in model.named_modules() if "forward" in m.__dict__]
    return hooks, wrapped


@pytest.mark.parametrize(
    "make,expected",
    [
        (llama, ["model.layers.0", "model.layers.1", "model.layers.2"]),  # one decoder stack
        (
            bart,  # both stacks of a seq2seq model
            [
                "model.encoder.layers.0",
                "model.encoder.layers.1",
                "model.decoder.layers.0",
                "model.decoder.layers.1",
            ],
        ),
    ],
)
def test_checkpoint_layers_wraps_every_stacks_layers_and_grads_equal_plain(make, expected):
    plain = make()
    model = copy.deepcopy(plain)
    assert hf.checkpoint_layers(model) == expected
    assert hf.layer_names(model) == expected
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert_same_step(model, plain, batch())


def test_checkpointed_layers_really_recompute():
    model = llama()
    hf.checkpoint_layers(model)
    inputs = batch()
    with remat.memory.track() as t_ck:
        model(**inputs).loss.backward()
    plain = llama()
    with remat.memory.track() as t_plain:
        plain(**inputs).loss.backward()
    assert t_ck.peak_bytes < t_plain.peak_bytes


def test_every_second_layer():
    model = llama(layers=4)
    assert hf.checkpoint_layers(model, every=2) == ["model.layers.0", "model.layers.2"]


def test_cache_is_off_in_training_and_kept_in_evaluation():
    plain = llama()
    model = copy.deepcopy(plain)
    hf.checkpoint_layers(model)
    inputs = batch()
    out = model(**inputs)  # config.use_cache is True: no cache created while training
    assert out.past_key_values is None
    model.eval()
    plain.eval()
    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"], use_cache=True)
        assert out.past_key_values is not None
        prompt = inputs["input_ids"][:, :4]
        kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(model.generate(prompt, **kw), plain.generate(prompt, **kw))


def test_explicit_use_cache_in_training_is_dropped_and_logged_once(caplog):
    plain = llama()
    model = copy.deepcopy(plain)
    hf.checkpoint_layers(model)
    inputs = {**batch(), "use_cache": True}
    with caplog.at_level(logging.WARNING, logger="remat"):
        assert_same_step(model, plain, inputs)
        model(**inputs)
    told = [r for r in caplog.records if "caching is incompatible" in r.getMessage()]
    assert len(told) == 1


def test_uncheckpoint_layers_leaves_the_plain_model():
    plain = llama()
    model = copy.deepcopy(plain)
    before = hooks_and_wraps(model)
    hf.checkpoint_layers(model)
    assert hooks_and_wraps(model) != before
    assert hf.uncheckpoint_layers(model) is model
    assert hooks_and_wraps(model) == before == (0, [])
    assert "_remat_hf_switch" not in model.__dict__
    with remat.memory.track() as t_model:
        model(**batch()).loss.backward()
    with remat.memory.track() as t_plain:
        plain(**batch()).loss.backward()
    assert t_model.peak_bytes == t_plain.peak_bytes  # nothing recomputed any more
    assert hf.uncheckpoint_layers(model) is model  # a no-op the second time


def test_checkpoint_layers_twice_replaces_the_first_switch():
    model = llama(layers=4)
    hf.checkpoint_layers(model)
    assert hf.checkpoint_layers(model, every=2) == ["model.layers.0", "model.layers.2"]
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == [
        "model.layers.0",
        "model.layers.2",
    ]


def test_transformers_own_checkpointing_on_is_turned_off_and_said(caplog):
    model = llama()
    model.activation_checkpointing_enable()
    with caplog.at_level(logging.WARNING, logger="remat"):
        names = hf.checkpoint_layers(model)
    assert names == hf.layer_names(model)
    assert not model.is_activation_checkpointing  # never checkpointed twice
    (said,) = [r.getMessage() for r in caplog.records if "turned it off" in r.getMessage()]
    assert "remat.integrations.hf.checkpoint_layers" in said
    assert "activation_checkpointing=True" in said and "activation_checkpointing_disable()" in said


def test_hf_auto_checkpoint_checks_its_options_before_touching_the_switch():
    model = llama()
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="bare number"):
        hf.auto_checkpoint(model, input_ids=torch.zeros(2, 4, dtype=torch.long), budget="50")
    with pytest.raises(ValueError, match="timer must be one of"):
        hf.auto_checkpoint(model, budget="50%", timer="x")
    assert model.is_activation_checkpointing  # untouched


def test_model_without_transformers_layers_asks_for_check_fn():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="check_fn"):
        hf.checkpoint_layers(model)
    assert hf.checkpoint_layers(model, check_fn=lambda n, m: n == "1") == ["1"]


def test_auto_checkpoint_plans_the_layers_within_the_budget_and_undoes():
    plain = llama(layers=4)
    model = copy.deepcopy(plain)
    inputs = {"input_ids": torch.randint(0, 64, (4, 32)), "labels": None}
    inputs["labels"] = inputs["input_ids"]
    opt = torch.optim.AdamW(model.parameters())
    plan = hf.auto_checkpoint(model, budget="50%", optimizer=opt, timer="flops", **inputs)
    assert list(plan.decisions) == hf.layer_names(model)
    assert any(d != "keep" for d in plan.decisions.values())
    assert remat.measure_peak(model, optimizer=opt, **inputs) <= plan.budget_bytes
    assert_same_step(model, plain, inputs)
    hf.uncheckpoint_layers(model)
    assert hooks_and_wraps(model) == (0, [])


def test_auto_checkpoint_that_fails_leaves_the_model_as_it_was():
    model = llama()
    with pytest.raises(remat.PlanError):
        hf.auto_checkpoint(model, budget=1, timer="flops", **batch())
    assert hooks_and_wraps(model) == (0, [])


def test_importing_remat_imports_no_framework():
    code = (
        "import sys, remat, remat.integrations\n"
        "assert 'transformers' not in sys.modules and 'lightning' not in sys.modules\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "module,package,extra",
    [
        ("remat.integrations.hf", "transformers", "hf"),
        ("remat.integrations.lightning", "lightning", "lightning"),
    ],
)
def test_missing_framework_names_the_extra_to_install(module, package, extra):
    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        f"try:\n    import {module}\nexcept ImportError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"pip install 'remat[{extra}]'" in done.stdout


def test_a_cache_passed_in_training_is_not_appended_to_by_the_layers(caplog):
    plain = llama()
    model = copy.deepcopy(plain)
    hf.checkpoint_layers(model)
    cache = transformers.DynamicCache(config=model.config)
    with caplog.at_level(logging.WARNING, logger="remat"):
        loss, grads = grads_of(model, {**batch(), "cache": cache})
    assert cache.get_seq_length() == 0  # the layers ran without it: nothing appended twice
    want_loss, want = grads_of(plain, batch())
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(grads[k], want[k]) for k in want)
    assert any("dropped cache" in r.getMessage() for r in caplog.records)
