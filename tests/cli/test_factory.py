"""``MODULE:FACTORY`` (remat.cli._factory): one reading of a factory for every subcommand,
keyword inputs through ``remat.Inputs`` included."""

from __future__ import annotations

import os

import pytest

from remat.cli import main
from tests.support.cli import one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "explain_models.py")


@pytest.mark.parametrize(
    "argv, says",
    [
        # each subcommand hands the model input_ids= and labels= (forward takes keywords only)
        (["plan", "--budget", "70%", "--timer", "flops"], "predicted step peak"),
        (["explain", "--wrap"], "remat explain: KeywordLM: one training step"),
        (["verify", "--budget", "70%", "--timer", "flops"], "remat.verify: OK"),
    ],
)
def test_a_factory_returning_inputs_passes_keyword_inputs_to_every_subcommand(argv, says, capsys):
    assert main([argv[0], f"{MODELS}:keyword_lm", *argv[1:]]) == 0, capsys.readouterr().err
    assert says in capsys.readouterr().out


def test_inputs_inside_a_tuple_is_refused_before_the_model_runs(capsys):
    rc = main(["explain", f"{MODELS}:keyword_lm_in_a_tuple"])
    err = one_error_line(capsys.readouterr().err, 2, rc)
    assert "returned a remat.Inputs inside a tuple; return it alone" in err


@pytest.mark.parametrize("command", ["plan", "explain", "verify"])
def test_every_subcommand_documents_the_factory_and_keyword_inputs(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "returning (model, example_args)" in text
    assert "remat.Inputs(input_ids=ids, labels=ids)" in text
