"""benchmarks/cost_model.py: every call of a family's blocks is classed, replayed and priced;
the per-block recompute costs are set against measured ones (numbers are not asserted:
they are the machine's)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from types import ModuleType

import pytest
import torch

from remat.planner.counting import CLASSES, OpCount, count_call, op_class

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "cost_model.py"


def _script() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("cost_model", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_operators_are_classed_by_what_they_compute():
    x = torch.randn(2, 4, 8, 16)
    w = torch.randn(8, 4, 3, 3)
    calls = count_call(
        lambda: (
            x @ x.transpose(-1, -2),
            torch.nn.functional.scaled_dot_product_attention(x, x, x),
            torch.nn.functional.conv2d(x, w),
            torch.nn.functional.layer_norm(x, (16,)),
            torch.nn.functional.group_norm(x, 2),
            torch.nn.functional.gelu(x),
            torch.nn.functional.dropout(x, 0.5),
            torch.cat([x, x]),
            x.clone(),
        )
    )
    got = [op_class(c) for c in calls if not c.op.startswith(("aten.transpose", "aten.slice"))]
    for expected in CLASSES:
        assert expected in got, (expected, [(c.op, op_class(c)) for c in calls])
    assert op_class(OpCount("aten.mul.Tensor", "other", None, 0.0, 8)) == "pointwise"


def test_a_replayed_call_sees_its_arguments_as_they_were():
    cm = _script()
    x = torch.zeros(4)
    rec = cm._Recorder()
    with torch.no_grad(), rec:
        y = x + 1
        y.mul_(3)  # changes y after the add made it: the add's record keeps its inputs
        x.add_(5)
    func, args, kwargs = rec.replays[0]
    assert torch.equal(args[0], torch.zeros(4))  # not the 5s of the later in-place add
    assert cm.time_call(func, args, kwargs, reps=2, rounds=1) >= 0.0


def test_tiny_run_writes_errors_per_class_and_per_block(tmp_path):
    out = tmp_path / "c.json"
    args = ["--tiny", "--families", "gpt,cnn", "--rounds", "1", "--reps", "2"]
    assert _script().main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())["results"]
    assert set(data) == {"gpt", "cnn"}
    assert {"matmul", "pointwise", "random", "normalisation"} <= set(data["gpt"]["classes"])
    assert "convolution" in data["cnn"]["classes"]
    for fam in data.values():
        assert "not replayed" not in fam["classes"], fam["classes"].get("not replayed")
        for row in fam["classes"].values():
            assert row["calls"] > 0 and row["modelled_s"] > 0 and row["measured_s"] > 0
        assert len(fam["per_block"]) == fam["blocks"] == 4
        for row in fam["per_block"].values():
            assert row["modelled_s"] > 0 and row["measured_s"] > 0
