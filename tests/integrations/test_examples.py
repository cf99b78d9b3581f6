"""examples/hf_trainer.py and examples/lightning_fit.py: the budget holds on every step they
print, and the losses equal those of the same run without remat.

(tests/test_examples.py runs every example too, checking only that it runs; these read
what the two print.) Each starts a fresh interpreter that imports its framework: slow.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,framework,steps",
    [
        ("hf_trainer.py", "transformers", 4),  # optimizer steps of two micro-batches
        ("lightning_fit.py", "lightning", 6),  # batches: three steps of two
    ],
)
def test_example_holds_the_budget_on_every_step_and_matches_the_plain_losses(
    script, framework, steps
):
    pytest.importorskip(framework)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    rows = re.findall(
        r"step \d+: peak ([\d.]+) MiB, predicted ([\d.]+) MiB, budget ([\d.]+) MiB \((\w+)\)", out
    )
    assert len(rows) == steps, out
    assert all(verdict == "within" for *_, verdict in rows), out
    assert all(float(peak) <= float(budget) for peak, _, budget, _ in rows), out
    with_remat = re.search(r"losses with remat:\s+(\[.*\])", out).group(1)
    without = re.search(r"losses without remat:\s+(\[.*\])", out).group(1)
    assert with_remat == without
    assert "budget held on every step: True; losses equal without remat: True" in out
    if script == "hf_trainer.py":  # transformers' own switch on: remat takes it over
        switched = re.search(r"activation_checkpointing=True and remat:\s+(\[.*\])", out).group(1)
        assert switched == without
        assert "with activation_checkpointing=True: losses equal without remat: True" in out
        assert done.stderr.count("remat turned it off") == 1
