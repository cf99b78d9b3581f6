"""``remat plan --shapes``: the plans of every profiled size, as ``auto_checkpoint(shapes=...)``
makes them, and a malformed value named in one line."""

from __future__ import annotations

import json

import pytest

from remat.cli import main
from tests.support.cli import one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = """
import torch

def make():
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                  torch.nn.Linear(64, 16)) for _ in range(3)]
    return torch.nn.Sequential(*blocks), (torch.randn(4, 64, 16),)
"""


def test_plan_shapes_prints_and_writes_the_plan_of_each_profiled_size(tmp_path, capsys):
    (tmp_path / "seq.py").write_text(SEQ)
    out = tmp_path / "plans.json"
    args = ["plan", f"{tmp_path / 'seq.py'}:make", "--budget", "70%", "--timer", "flops"]
    assert main([*args, "--shapes", "1:8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "plans for sizes up to 64 along dimension(s) [1]" in text
    assert "at size 16:" in text and "at size 64:" in text
    data = json.loads(out.read_text())
    assert {"16", "32", "64"} <= set(data)
    assert all(p["predicted_peak_bytes"] + p["scratch_bytes"] <= p["budget_bytes"]
               for p in data.values())  # fmt: skip
    assert len({p["budget_bytes"] for p in data.values()}) == 1


@pytest.mark.parametrize(
    ("value", "match"),
    [("x", "--shapes 'x': expected DIMS[:MULTIPLE]"), ("1:0", "multiple must be an int >= 1")],
)
def test_plan_shapes_malformed_value_is_one_line(value, match, capsys):
    assert main(["plan", "--budget", "50%", "--shapes", value]) == 2
    assert match in one_error_line(capsys.readouterr().err, 2, 2)
