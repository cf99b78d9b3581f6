"""The scripts under examples/ run as the README says."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))

#: Examples that start several processes: slow tests, as the project's multi-process ones.
MULTI_PROCESS = {"torchrun_plan.py", "pipeline_plan.py"}

#: Examples that train with a framework's trainer (11-13 s each): slow tests too.
TRAINERS = {"hf_trainer.py", "lightning_fit.py"}


def _param(script: pathlib.Path) -> object:
    marks = [pytest.mark.slow] if script.name in MULTI_PROCESS | TRAINERS else []
    return pytest.param(script, id=script.name, marks=marks)


@pytest.mark.parametrize("script", [_param(p) for p in EXAMPLES])
def test_example_script_runs_and_prints_its_result(script):
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
