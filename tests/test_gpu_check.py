"""benchmarks/gpu_check.py: its dry run passes on CPU, and its parts are guarded.

The script's parts are in benchmarks/gpucheck/. The dry run is the script's whole code on CPU with tiny sizes (offload on the simulated
device), so that the script a GPU session runs cannot rot between GPU sessions.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def script() -> Iterator[SimpleNamespace]:
    """The script's modules (benchmarks/gpucheck), benchmarks/ on sys.path while imported."""
    path = str(ROOT / "benchmarks")
    sys.path.insert(0, path)
    try:
        device = importlib.import_module("gpucheck.device")
        parts = importlib.import_module("gpucheck.parts")
        run = importlib.import_module("gpucheck.run")
        shapes = importlib.import_module("gpucheck.shapes")
        suite = importlib.import_module("gpucheck.suite")
        summary = importlib.import_module("gpucheck.summary")
    finally:
        sys.path.remove(path)
    yield SimpleNamespace(
        device=device, parts=parts, run=run, shapes=shapes, suite=suite, summary=summary
    )


def _check(
    script: SimpleNamespace, tmp_path: Path
) -> Any:  # a dry-run Check writing under tmp_path
    return script.device.Check(torch.device("cpu"), True, script.device.DRY_SIZES, tmp_path)


def _summary() -> dict:
    return {"command": "test", "dry_run": True, "started": "now", "parts": {}}


@pytest.mark.slow  # 12-16 s: every part of the GPU check, dry
def test_dry_run_runs_every_part_and_writes_the_summary(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = summary["parts"]
    assert list(parts) == list(script.parts.PARTS)
    assert {n: p["status"] for n, p in parts.items()} == {n: "ok" for n in parts}, {
        n: p.get("error") for n, p in parts.items()
    }
    # pytest -m gpu ran and every GPU test skipped on CPU (none passed, none failed)
    counts = parts["pytest"]["results"]["counts"]
    assert counts["skipped"] > 0 and counts["passed"] == counts["failed"] == counts["error"] == 0
    # every model and precision measured plans, the offload decision among the profiled
    configs = parts["planner"]["results"]["configs"]
    assert [(c["model"], c["precision"]) for c in configs] == [
        ("gpt", "fp32"),
        ("gpt", "bf16-autocast"),
        ("cnn", "fp32"),
        ("cnn", "bf16-autocast"),
        ("encdec", "fp32"),
        ("encdec", "bf16-autocast"),
    ]
    for c in configs:
        assert "offload" in c["decisions"]  # the simulated device offers it
        assert c["stats"]["measured"] == len(c["plans"]) == script.device.DRY_SIZES.max_plans
    # a plan from shapes measured as predicted (the CPU's calibration saved under --out)
    shapes = parts["shapes"]["results"]
    assert [r["precision"] for r in shapes["rows"]] == ["fp32", "bf16", "amp"]
    assert shapes["rows"][0]["tracker"] == shapes["rows"][0]["predicted"]
    assert shapes["rows"][2]["tracker"] == shapes["rows"][2]["predicted"]  # a fake copy, exact
    assert Path(shapes["calibration"]).parent == tmp_path
    # the bench ran the offload strategies, with the reference's gradients
    rows = {r["strategy"]: r for r in parts["bench"]["results"]["data"]["rows"]}
    assert {"offload", "offload-blocks", "auto-50%"} <= set(rows)
    assert all(r["max_grad_diff"] == 0.0 for r in rows.values())
    # every offload case stepped and gave no checkpointing's gradients (bitwise on CPU)
    cases = parts["offload"]["results"]["cases"]
    assert list(cases) == list(script.parts.OFFLOAD_CASES)
    assert all(c["max_grad_diff"] == 0.0 and c["step_times_s"] for c in cases.values())
    assert "non-reentrant" in parts["overhead"]["results"]["ratios"]["sin"]
    # the suite ran (its dry-run files) under this torch, which is recorded with the counts
    suite = parts["suite"]["results"]
    assert suite["torch"] == torch.__version__ and suite["shards"] == 2
    assert suite["counts"]["passed"] > 0 and suite["counts"]["failed"] == 0
    md = (tmp_path / "summary.md").read_text()
    assert f"torch {torch.__version__}" in md.splitlines()[0]
    for heading in (
        "pytest -m gpu",
        "Planner exactness",
        "Plans from shapes",
        "remat bench",
        "Offload",
        "overhead",
        f"The default test suite (`python -m pytest -q`), torch {torch.__version__}",
    ):
        assert heading in md
    assert md in done.stdout  # printed as written
    assert took < 120  # the bar is a minute; generous for a loaded machine


def test_a_failing_part_is_recorded_and_the_next_part_runs(script, tmp_path):
    check, summary = _check(script, tmp_path), _summary()

    def broken(check, found, deadline):
        found["before"] = 1
        raise RuntimeError("boom")

    def fine(check, found, deadline):
        found["value"] = 2

    script.run.run_part("broken", broken, check, summary, limit_s=5)
    script.run.run_part("fine", fine, check, summary, limit_s=5)
    saved = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert saved["broken"]["status"] == "error"
    assert saved["broken"]["error"] == "RuntimeError: boom"
    assert "raise RuntimeError" in saved["broken"]["traceback"]
    assert saved["broken"]["results"] == {"before": 1}  # what it had is kept
    assert saved["fine"]["status"] == "ok" and saved["fine"]["results"] == {"value": 2}
    assert not script.run.succeeded(summary)
    assert "RuntimeError: boom" in (tmp_path / "summary.md").read_text()


def test_a_part_past_its_hard_limit_is_interrupted_and_recorded(script, tmp_path):
    check, summary = _check(script, tmp_path), _summary()

    def stuck(check, found, deadline):
        found["started"] = True
        time.sleep(30)

    start = time.monotonic()
    entry = script.run.run_part("stuck", stuck, check, summary, limit_s=0.2, grace_s=0.1)
    assert time.monotonic() - start < 5
    assert entry["status"] == "timeout" and "hard limit" in entry["error"]
    assert entry["results"] == {"started": True}
    # the alarm is off again: sleeping past the limit now is not interrupted
    time.sleep(0.5)


def test_a_part_that_stops_at_its_limit_is_partial_and_counts_as_run(script, tmp_path):
    check, summary = _check(script, tmp_path), _summary()

    def sampling(check, found, deadline):
        found["done"] = 0
        while not deadline.passed():
            found["done"] += 1
            time.sleep(0.01)
        found["cut_short"] = "time limit"

    assert (
        script.run.run_part("sampling", sampling, check, summary, limit_s=0.1)["status"]
        == "partial"
    )
    assert script.run.succeeded(summary)


@pytest.mark.parametrize(
    "xml, counts",
    [
        # one of each outcome, as pytest writes them
        (
            '<testsuites><testsuite><testcase classname="t" name="a"/>'
            '<testcase classname="t" name="b"><failure message="assert 1 == 2"/></testcase>'
            '<testcase classname="t" name="c"><error message="fixture"/></testcase>'
            '<testcase classname="t" name="d"><skipped message="needs a CUDA device"/>'
            "</testcase></testsuite></testsuites>",
            {"passed": 1, "failed": 1, "error": 1, "skipped": 1},
        ),
        # nothing collected
        (
            "<testsuites><testsuite/></testsuites>",
            {"passed": 0, "failed": 0, "error": 0, "skipped": 0},
        ),
    ],
)
def test_junit_outcomes_count_each_outcome_with_its_message(script, tmp_path, xml, counts):
    path = tmp_path / "junit.xml"
    path.write_text(xml)
    got = script.parts.junit_outcomes(path)
    assert got["counts"] == counts
    messages = {t["test"]: t["message"] for t in got["tests"]}
    assert messages.get("t::b", "assert 1 == 2") == "assert 1 == 2"


@pytest.mark.slow  # 13 s: it calibrates the CPU for three dtypes
def test_shapes_part_saves_a_calibration_and_measures_a_plan_from_shapes_as_predicted(
    script, tmp_path
):
    from remat.planner import calibration

    check, summary = _check(script, tmp_path), _summary()
    entry = script.run.run_part("shapes", script.parts.PARTS["shapes"], check, summary, 60)
    assert entry["status"] == "ok", entry.get("error")
    found = entry["results"]
    saved = Path(found["calibration"])
    assert saved.parent == tmp_path  # a dry run leaves the repository's calibrations alone
    assert calibration.named(saved, torch.float32) == calibration.constants(
        torch.device("cpu"), torch.float32, 1
    )
    fp32 = found["rows"][0]
    # the tensors' bytes of a plan from shapes are those of the real step, and of a
    # profile on the device
    assert fp32["tracker"] == fp32["predicted"] == fp32["on_device_predicted"]
    assert fp32["predicted"] <= fp32["budget"]
    amp = found["rows"][2]  # a fake copy under autocast: the real step's bytes too
    assert amp["precision"] == "amp"
    assert amp["tracker"] == amp["predicted"] == amp["on_device_predicted"]


@pytest.mark.parametrize(
    ("name", "file"),
    [("NVIDIA H200", "nvidia-h200"), ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3")],
)
def test_calibration_file_is_named_after_the_gpu(script, name, file):
    assert script.shapes.slug(name) == file


def test_suite_shards_cover_every_test_file_and_the_doctests_once(script):
    suite = script.suite
    items = suite.suite_items(ROOT)
    assert "src/remat" in items and "tests/engine/test_torch_compat.py" in items
    groups = suite.shards(items, 4, ROOT)
    assert len(groups) == 4 and all(groups)
    assert sorted(i for g in groups for i in g) == sorted(items)


def test_suite_part_is_rendered_with_its_torch_and_counts_it_in_the_verdict(script):
    summary = _summary()
    found = {
        "torch": "2.14.1+cu130",
        "shards": 8,
        "counts": {"passed": 3, "failed": 1, "error": 0, "skipped": 2},
        "not_passed": [{"test": "t::x", "outcome": "failed", "message": "boom"}],
    }
    summary["parts"]["suite"] = {"status": "ok", "seconds": 1.0, "limit_s": 180, "results": found}
    md = script.summary.render(summary)
    assert "torch 2.14.1+cu130" in md.splitlines()[0]
    assert "3 passed, 1 failed, 0 error, 2 skipped (8 shards side by side)." in md
    assert "- failed: `t::x`: boom" in md
    assert not script.run.succeeded(summary)
