"""``remat verify`` (remat.cli.verify): a plan saved by ``remat plan --json`` (or planned on
the spot) applied and run on real steps, its measured peak beside the prediction, gradients
compared bitwise; every mistake found before a step runs."""

from __future__ import annotations

import json
import os

import pytest

import remat
from remat.cli import main
from tests.support.cli import one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "explain_models.py")
LM = f"{MODELS}:keyword_lm"


def test_a_plan_saved_by_remat_plan_is_verified_exactly(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = [LM, "--budget", "70%", "--timer", "flops", "--optimizer", "adamw"]
    assert main(["plan", *argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    # the plan's output says how to apply the file and how to check it
    assert f"plan = remat.Plan.load({str(path)!r}); plan.apply(model)" in out
    assert f"remat verify {LM} --plan {path}" in out
    saved = remat.Plan.load(path)
    assert main(["verify", LM, "--plan", str(path), "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert f"applied {path} ({len(saved.decisions)} blocks: " in out
    # the prediction is exact on CPU for a chain of blocks, and the grads bitwise
    assert f"predicted {remat.planner.render.fmt_bytes(saved.predicted_peak_bytes)} (exact)" in out
    assert "remat.verify: OK" in out


def test_verify_without_a_plan_checks_the_model_as_the_factory_returns_it(capsys):
    assert main(["verify", f"{MODELS}:gpt_wrapped"]) == 0
    out = capsys.readouterr().out
    assert "remat.verify: OK" in out and "predicted" not in out


def test_a_peak_over_the_plans_budget_exits_1_after_the_report(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", LM, "--budget", "70%", "--timer", "flops", "--json", str(path)]) == 0
    capsys.readouterr()
    data = json.loads(path.read_text())
    data["budget_bytes"] = 1024  # a budget no step meets
    path.write_text(json.dumps(data))
    assert main(["verify", LM, "--plan", str(path)]) == 1
    done = capsys.readouterr()
    assert "budget 1.00 KiB: OVER" in done.out and "remat.verify: OK" in done.out
    assert "is over the plan's budget 1.00 KiB" in done.err


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--plan", "missing.json"], "--plan missing.json: no such file"),
        (["--plan", "FILE:not json"], "not a plan remat can read: Plan.load("),
        (
            [
                "--plan",
                'FILE:{"decisions": {"layers.0": "recompute"}, "predicted_peak_bytes": 1, '
                '"predicted_overhead_s": 0.0, "unchecked_peak_bytes": 1, "budget_bytes": 1}',
            ],
            "the model has no submodule named layers.0; the plan was made for another model",
        ),
        (["--plan", "p.json", "--budget", "50%"], "not allowed with argument"),
        (["--blocks", "blocks.*"], "--blocks 'blocks.*' picks the blocks to plan for --budget"),
        (["--timer", "flops"], "--timer flops prices a plan made for --budget"),
        (["--budget", "abc"], "--budget 'abc'"),
        (["--budget", "50%", "--blocks", "layer.*"], "--blocks 'layer.*' selects no module"),
    ],
)
def test_verify_usage_mistakes_exit_2_before_any_step(argv, text, tmp_path, capsys):
    argv = [
        _write(tmp_path, "plan.json", a.removeprefix("FILE:")) if a.startswith("FILE:") else a
        for a in argv
    ]
    rc = main(["verify", LM, *argv])
    err = capsys.readouterr().err
    if "not allowed" in text:  # argparse's own message for two exclusive options
        assert rc == 2 and text in err
        return
    assert text in one_error_line(err, 2, rc)


def test_verify_refuses_a_model_on_the_meta_device(tmp_path, capsys):
    path = _write(
        tmp_path,
        "meta_models.py",
        "import torch\n"
        "def make():\n"
        "    with torch.device('meta'):\n"
        "        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))\n"
        "        return m, (torch.randn(2, 4),)\n",
    )
    rc = main(["verify", f"{path}:make", "--budget", "50%"])
    assert "a model on the meta device has none" in one_error_line(capsys.readouterr().err, 2, rc)


def test_gradients_that_differ_exit_1_after_the_report(tmp_path, capsys):
    # a forward that counts its calls: the recompute scales by another number
    path = _write(
        tmp_path,
        "counting_models.py",
        "import torch, remat\n"
        "class Counting(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "        self.calls = 0\n"
        "    def forward(self, x):\n"
        "        self.calls += 1\n"
        "        return (self.lin(x) * self.calls).sin()\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(Counting(), Counting())\n"
        "    remat.apply_activation_checkpointing(model)\n"
        "    return model, (torch.randn(2, 4),)\n",
    )
    assert main(["verify", f"{path}:make"]) == 1
    done = capsys.readouterr()
    assert "remat.verify: DIFFERENCES FOUND" in done.out
    assert done.err.startswith("remat verify: error: ") and "differ with checkpointing" in done.err
