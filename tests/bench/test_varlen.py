"""benchmarks/varlen.py: its quick run goes through the whole script (three runs, the JSON the
issue asks for); no timing is asserted."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_run_writes_every_field_within_budget_and_bitwise(tmp_path):
    out = tmp_path / "varlen.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "varlen.py"), "--quick", "--json", str(out)],
        check=True, env=env, capture_output=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    budget = result["budget_bytes"]
    assert isinstance(budget, int) and budget > 0
    lengths = result["workload"]["lengths"]
    assert len(lengths) == 6 and all(8 <= n <= 64 for n in lengths)
    for name in ("adaptive", "longest", "torch_every_block"):
        run = result[name]
        assert [s["tokens"] for s in run["steps"]] == lengths
        assert all(s["time_s"] > 0 and s["peak_bytes"] > 0 for s in run["steps"])
        assert run["total_time_s"] == sum(s["time_s"] for s in run["steps"])
        assert run["grads_bitwise"] is True
    assert all(s["peak_bytes"] <= budget for s in result["adaptive"]["steps"])
    assert result["summary"]["steps_over_budget"]["adaptive"] == 0
