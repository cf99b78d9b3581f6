"""benchmarks/planner_quality.py: its tiny run brute-forces each family and writes the JSON of
the planner-quality table (chosen plan against the fastest fitting one, with spread)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from types import ModuleType

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "planner_quality.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("planner_quality", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(out: dict, families: list[str], rounds: int) -> None:
    assert out["environment"]["clock"] == "thread_time" and "load_average" in out["environment"]
    assert [f["family"] for f in out["families"]] == families
    for fam in out["families"]:
        times = fam["plan_times"]
        assert len(times) == 2 ** len(fam["blocks"])  # keep, recompute per block
        assert all(len(v) == rounds for v in times.values())
        assert fam["rows"], fam["family"]
        for row in fam["rows"]:
            if row["plan"] is None:  # refused: the measured peaks say whether a plan fits
                assert row["fitting_plans"] >= 0
                continue
            assert row["met"], row  # a plan is never over its budget
            assert row["best_time"] <= row["plan_time"] and row["rank"] >= 1
            assert row["within_noise"] == (
                row["plan_time"] <= row["best_time"] + max(row["plan_iqr"], row["best_iqr"])
            )


def test_tiny_run_writes_the_quality_table(tmp_path):
    out = tmp_path / "q.json"
    args = ["--tiny", "--families", "gpt", "--rounds", "2", "--budgets", "70,50"]
    assert _script().main([*args, "--decisions", "keep,recompute", "--json", str(out)]) == 0
    _check(json.loads(out.read_text()), ["gpt"], 2)


@pytest.mark.slow
def test_tiny_run_of_every_family(tmp_path):
    out = tmp_path / "q.json"
    args = ["--tiny", "--rounds", "2", "--timers", "time,flops", "--decisions", "keep,recompute"]
    assert _script().main([*args, "--json", str(out)]) == 0
    _check(json.loads(out.read_text()), ["gpt", "cnn", "encdec"], 2)
