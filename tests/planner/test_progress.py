"""Progress while planning: a stage line per stage and a bar over countable steps (a
profile's steps, the sizes of shapes=) on standard error; nothing with quiet=True."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

import remat
from remat.planner.progress import Progress, bar
from tests.support.plans import make_model


class Terminal(io.StringIO):
    """Standard error on a terminal: the bar is drawn only there."""

    def isatty(self) -> bool:
        return True


def on_terminal() -> contextlib.redirect_stderr[Terminal]:
    """Standard error a terminal, inside the test's body (pytest's capture sets its own
    around the body: a fixture's would be replaced)."""
    return contextlib.redirect_stderr(Terminal())


def test_auto_checkpoint_counts_the_profiles_steps_on_a_bar():
    model, x = make_model("mlp")
    with on_terminal() as terminal:
        remat.auto_checkpoint(model, x, budget="95%", timer="flops")
    err = terminal.getvalue()
    assert "remat.auto_checkpoint: profiling from shapes" in err  # the stage line
    counts = re.findall(r"remat\.auto_checkpoint: profiling: +\d+%\|[^|]*\| (\d+)/(\d+)", err)
    assert counts and all(total == counts[0][1] for _, total in counts)
    assert "planned, measured peak" in err


def test_auto_checkpoint_quiet_prints_nothing():
    model, x = make_model("mlp")
    with on_terminal() as terminal:
        remat.auto_checkpoint(model, x, budget="95%", timer="flops", quiet=True)
    assert terminal.getvalue() == ""


def test_no_bar_is_drawn_into_a_log_or_a_pipe(capsys):
    model, x = make_model("mlp")
    remat.auto_checkpoint(model, x, budget="95%", timer="flops")
    err = capsys.readouterr().err
    assert "remat.auto_checkpoint: profiling from shapes" in err  # the stage lines only
    assert "%|" not in err


def test_shapes_counts_the_profiled_sizes_on_a_bar():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    with on_terminal() as terminal:
        plans = remat.auto_checkpoint(
            model, torch.randn(2, 16, 16), budget="100%", timer="flops", shapes=remat.Shapes(1)
        )
    plans.remove()
    err = terminal.getvalue()
    assert re.search(r"profiling sizes: +\d+%\|[^|]*\| \d+/3", err)  # sizes 4, 8 and 16


def test_a_bar_outside_planning_or_when_quiet_draws_nothing():
    out = Terminal()
    with Progress("remat.auto_checkpoint", quiet=True, stream=out).active(), bar(3, "x") as b:
        b.update()
    with bar(3, "x") as b:  # no planning under way (a bare remat.profile)
        b.update()
    assert out.getvalue() == ""


def test_hf_auto_checkpoint_which_the_callback_plans_with_shows_the_bar():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from remat.integrations import hf
    from tests.support.hf_models import llama

    model, batch = llama()
    with on_terminal() as terminal:
        plan = hf.auto_checkpoint(model, budget="100%", timer="flops", **batch)
    assert plan is not None
    err = terminal.getvalue()
    assert re.search(r"remat\.auto_checkpoint: profiling: +\d+%\|", err)
