"""``remat.explain``: every tensor kept at the end of forward, why, and where the peak falls."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn

import remat
import tests.support.explain_models as em
from remat.engine import observe

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {"module", "op", "shape", "dtype", "bytes", "line", "reason"}
REASONS = {"not checkpointed", "region input", "selective save", "offloaded", "output", "other"}


def call(model, args):
    """``remat.explain`` with positional or keyword inputs, as a factory returned them."""
    if isinstance(args, dict):
        return lambda **kw: remat.explain(model, **args, **kw)
    return lambda **kw: remat.explain(model, *args, **kw)


def alive_at_end_of_forward(model, args, loss_fn) -> int:
    """What remat.memory.track counts alive once the loss is computed, on its own."""
    with remat.memory.track() as t:
        out = model(**args) if isinstance(args, dict) else model(*args)
        loss = loss_fn(out)
        alive = t.current_bytes
    del out, loss
    return alive


FACTORIES = {
    # name: (factory, loss); the HF decoder needs transformers
    "gpt": (em.gpt, em.LOSSES["gpt"]),
    "gpt-wrapped": (em.gpt_wrapped, em.LOSSES["gpt"]),
    "llama": (em.llama, em.LOSSES["llama"]),
    "llama-wrapped": ("llama-wrapped", em.LOSSES["llama"]),
    "cnn": (em.cnn, em.LOSSES["cnn"]),
    "cnn-wrapped": (em.cnn_wrapped, em.LOSSES["cnn"]),
}


def build(name):
    factory, loss = FACTORIES[name]
    if name.startswith("llama"):
        pytest.importorskip("transformers")
        model, args = em.llama()
        if name == "llama-wrapped":
            remat.apply_activation_checkpointing(model)
        return model, args, loss
    model, args = factory()
    return model, args, loss


@pytest.mark.parametrize("name", list(FACTORIES))
def test_rows_add_up_to_what_memory_track_counts_at_the_end_of_forward(name):
    model, args, loss_fn = build(name)
    report = call(model, args)(loss_fn=loss_fn)
    assert report.tensors, "a training step keeps something"
    assert sum(t.bytes for t in report.tensors) == report.total_bytes
    assert report.total_bytes == alive_at_end_of_forward(model, args, loss_fn)
    # every byte was seen made: no row of unattributed bytes
    assert all(t.op and t.dtype is not None for t in report.tensors)


@pytest.mark.parametrize("name", ["gpt-wrapped", "llama-wrapped", "cnn-wrapped"])
def test_json_has_the_documented_fields_and_its_bytes_add_up(name):
    model, args, loss_fn = build(name)
    data = json.loads(call(model, args)(loss_fn=loss_fn).to_json())
    assert {"tensors", "total_bytes", "peak", "diagnostics", "by_module", "by_reason"} <= set(data)
    for row in data["tensors"]:
        assert FIELDS <= set(row)
        assert row["reason"] in REASONS
    assert sum(row["bytes"] for row in data["tensors"]) == data["total_bytes"]
    assert sum(data["by_module"].values()) == data["total_bytes"]
    assert sum(data["by_reason"].values()) == data["total_bytes"]


def test_checkpointed_blocks_keep_their_inputs_and_drop_the_rest():
    model, args = em.gpt_wrapped()
    cfg = model.cfg
    act = cfg.batch * cfg.seq * cfg.d_model * 4
    report = remat.explain(model, *args)
    inputs = [t for t in report.tensors if t.reason.value == "region input"]
    # block i keeps block i-1's output; block 0 keeps the embedding sum
    assert sorted(t.kept_by for t in inputs) == [f"blocks.{i}" for i in range(cfg.layers)]
    assert all(t.bytes == act and t.shape == (cfg.batch, cfg.seq, cfg.d_model) for t in inputs)
    assert [t.module for t in inputs] == ["<GPT>"] + [f"blocks.{i}" for i in range(cfg.layers - 1)]
    # nothing from inside a block is kept
    assert not any(t.module.startswith("blocks.") and "." in t.module[7:] for t in report.tensors)
    regions = {r.label: r for r in report.regions}
    assert sorted(regions) == [f"blocks.{i}" for i in range(cfg.layers)]
    assert all(
        r.calls == 1 and r.recomputes == 1 and r.dropped_bytes > act for r in regions.values()
    )


def test_unwrapped_model_keeps_what_autograd_saves_with_the_module_and_line_that_made_it():
    model, args = em.gpt()
    report = remat.explain(model, *args)
    gelu = [t for t in report.tensors if t.op == "aten.gelu.default"]
    assert len(gelu) == model.cfg.layers
    for i, t in enumerate(gelu):
        assert t.module == f"blocks.{i}"
        assert t.reason.value == "not checkpointed"
        assert t.line.startswith("models.py:")  # the GPTBlock's forward, not torch's code
    assert report.regions == []


def test_selective_saves_are_listed_as_such():
    torch.manual_seed(0)
    block = em.MLPBlock(16, 64)
    remat.checkpoint_wrapper(block, policy=[torch.ops.aten.addmm.default])
    x = torch.randn(8, 16, requires_grad=True)
    report = remat.explain(nn.Sequential(block), x)
    saved = [t for t in report.tensors if t.reason.value == "selective save"]
    assert [(t.module, t.shape) for t in saved] == [("0.up", (8, 64)), ("0.down", (8, 16))]
    assert all(t.kept_by == "0" for t in saved)


def test_offloaded_tensors_are_listed_as_such():
    torch.manual_seed(0)
    model = nn.Sequential(em.MLPBlock(16, 64), em.MLPBlock(16, 64))
    remat.offload_wrapper(model[1])
    x = torch.randn(8, 16, requires_grad=True)
    report = remat.explain(model, x)
    offloaded = {t.module for t in report.tensors if t.reason.value == "offloaded"}
    kept = {t.module for t in report.tensors if t.reason.value == "not checkpointed"}
    assert offloaded and all(m.startswith("1") for m in offloaded)
    assert kept and all(m.startswith("0") for m in kept)


def test_selective_offload_policy_is_listed_as_offloaded():
    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.addmm.default:
            return remat.CheckpointPolicy.MUST_CPU_OFFLOAD
        return remat.CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block = remat.checkpoint_wrapper(em.MLPBlock(16, 64), policy=policy)
    x = torch.randn(8, 16, requires_grad=True)
    report = remat.explain(nn.Sequential(block), x)
    offloaded = [(t.module, t.shape) for t in report.tensors if t.reason.value == "offloaded"]
    assert offloaded == [("0.up", (8, 64)), ("0.down", (8, 16))]
    assert sum(t.bytes for t in report.tensors) == report.total_bytes


def test_reentrant_checkpoints_keep_their_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(*[em.MLPBlock(32, 256) for _ in range(3)])
    remat.apply_activation_checkpointing(model, use_reentrant=True)
    x = torch.randn(32, 32, requires_grad=True)
    report = remat.explain(model, x)
    inputs = [(t.module, t.kept_by) for t in report.tensors if t.reason.value == "region input"]
    assert inputs == [("0", "1"), ("1", "2")]  # block 0's input is x, from before the step
    assert [(r.label, r.kind, r.dropped_bytes) for r in report.regions] == [
        ("0", "reentrant", -1),
        ("1", "reentrant", -1),
        ("2", "reentrant", -1),
    ]
    assert "drops          ?" in str(report)
    assert report.diagnostics == []


def test_torchs_checkpoint_inputs_are_region_inputs():
    torch.manual_seed(0)
    blocks = nn.ModuleList(em.MLPBlock(16, 64) for _ in range(2))

    def fn(x):
        for b in blocks:
            x = tuc.checkpoint(b, x, use_reentrant=False)
        return x

    x = torch.randn(8, 16, requires_grad=True)
    report = remat.explain(fn, x)
    inputs = [t for t in report.tensors if t.reason.value == "region input"]
    # torch's checkpoint before 2.13 keeps the inputs through its _NoopSaveInputs, which
    # also saves an empty placeholder of its own per call (0 bytes); 2.13's has neither
    placeholders = 2 if hasattr(tuc, "_NoopSaveInputs") else 0
    empty = [(t.op, t.shape, t.bytes) for t in inputs if t.shape == (0,)]
    assert empty == [("aten.empty.memory_format", (0,), 0)] * placeholders
    inputs = [t for t in inputs if t.shape != (0,)]
    assert len(inputs) == 1 and inputs[0].module == "MLPBlock"  # block 1's input
    assert "torch.utils.checkpoint" in inputs[0].kept_by


def test_peaks_are_those_of_the_step_with_and_without_checkpointing():
    model, args = em.gpt_wrapped()
    report = remat.explain(model, *args, loss_fn=em.LOSSES["gpt"])

    def peak():
        with remat.memory.track() as t:
            model(*args).backward()
        for p in model.parameters():
            p.grad = None
        return t.peak_bytes

    assert report.peak.bytes == peak()
    with remat.disable_checkpointing():
        assert report.peak.plain_bytes == peak()
    assert report.peak.bytes < report.peak.plain_bytes
    assert report.peak.phase == "backward"


def test_peak_in_a_recompute_names_the_region():
    model, x = em.scratch_first(wrap_scratch=True)
    report = remat.explain(model, x)
    assert report.peak.recompute_of == "0"
    assert report.peak.phase == "backward"
    assert "recomputing 0" in report.peak.describe()


def test_explain_leaves_no_trace():
    model, args = em.gpt_wrapped()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    hooks = (
        dict(torch.nn.modules.module._global_forward_pre_hooks),
        dict(torch.nn.modules.module._global_forward_hooks),
    )
    remat.explain(model, *args)
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    assert all(bool((p.grad == 7).all()) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert observe.current() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert hooks == (
        dict(torch.nn.modules.module._global_forward_pre_hooks),
        dict(torch.nn.modules.module._global_forward_hooks),
    )


def test_batchnorm_statistics_are_put_back():
    model, args = em.cnn()
    before = {n: b.clone() for n, b in model.named_buffers()}
    remat.explain(model, *args)
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n


def test_a_probed_step_gives_the_gradients_of_a_plain_one():
    # verify runs its checkpointed step under explain's probe: still bitwise
    model, args = em.gpt_wrapped()
    assert remat.verify(model, *args).ok


def test_a_function_is_explained_with_its_modules_named_by_class():
    lin = nn.Linear(8, 32)
    x = torch.randn(4, 8)

    def step(t):
        return torch.nn.functional.gelu(lin(t)).exp().sum()

    report = remat.explain(step, x)
    rows = {t.op: t for t in report.tensors}
    assert rows["aten.addmm.default"].module == "Linear"  # gelu saves it
    assert rows["aten.exp.default"].module == "<step>"  # exp saves its output
    assert rows["aten.addmm.default"].bytes == rows["aten.exp.default"].bytes == 4 * 32 * 4
    assert "aten.gelu.default" not in rows  # freed: nothing keeps it


@pytest.mark.parametrize(
    "target, error, match",
    [
        (42, TypeError, "model_or_fn must be an nn.Module or a function, got int"),
    ],
)
def test_bad_arguments_say_what_to_pass(target, error, match):
    with pytest.raises(error, match=match):
        remat.explain(target, torch.randn(2))


def test_under_no_grad_it_says_to_call_it_outside():
    with torch.no_grad(), pytest.raises(RuntimeError, match="gradients disabled"):
        remat.explain(nn.Linear(2, 2), torch.randn(1, 2))


def test_table_shows_reasons_modules_tensors_peak_and_checkpoints():
    model, args = em.gpt_wrapped()
    text = str(remat.explain(model, *args))
    for part in (
        "remat explain: GPT: one training step",
        "Alive at the end of forward",
        "by reason",
        "region input",
        "by module (a block with its submodules)",
        "input of blocks.1",
        "Peak of the step:",
        "without checkpointing",
        "checkpoints",
        "No boundary warnings.",
    ):
        assert part in text, part
    # one line per tensor at most 25; every line fits a wide terminal
    assert max(len(line) for line in text.splitlines()) < 160


def test_table_of_top_n_lists_the_largest():
    model, args = em.gpt()
    report = remat.explain(model, *args)
    text = report.table(top=3)
    assert f"the 3 largest of {len(report.tensors)}" in text
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["module", "op"])
    rows = lines[head + 1 : head + 4]
    assert lines[head + 4] == ""  # three rows, then the peak
    biggest = sorted(report.tensors, key=lambda t: -t.bytes)[:3]
    for row, t in zip(rows, biggest):
        assert row.split()[:2] == [t.module, t.op.split(".")[1]]
    assert len(report.table(top=None).splitlines()) == len(lines) + len(report.tensors) - 3


def test_explain_and_diagnose_agree():
    from remat.measure.explain import diagnose

    model, x = em.scratch_first(wrap_scratch=True)
    assert diagnose(model, x) == remat.explain(model, x).diagnostics


def test_the_observer_is_installed_only_inside_the_probe():
    # without explain, the engine builds its plain objects (no per-tensor observer work)
    seen = []
    policy = functools.partial(remat.create_selective_checkpoint_contexts, [])

    def fn(x):
        seen.append(observe.current())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    remat.checkpoint(fn, x, context_fn=policy).sum().backward()
    assert seen == [None, None]


def test_the_explained_peak_says_it_is_above_the_steps_start():
    model, args = em.gpt_wrapped()
    text = str(remat.explain(model, *args))
    after = text.split("Peak of the step:", 1)[1].splitlines()[1]
    assert "above its start" in after and "remat.measure_peak" in after
