"""``remat explain [MODULE:FACTORY]``: the table on the terminal, the JSON in a file."""

from __future__ import annotations

import json
import os

import pytest

from remat.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "explain_models.py")
FIELDS = {"module", "op", "shape", "dtype", "bytes", "line", "reason"}


@pytest.mark.parametrize(
    "factory, title",
    [
        ("gpt_wrapped", "GPT"),  # the built-in decoder, blocks checkpointed
        ("llama_ids", "LlamaForCausalLM"),  # a Hugging Face decoder, layers checkpointed
        ("cnn_wrapped", "Sequential"),  # a CNN, conv blocks checkpointed
    ],
)
def test_explain_prints_the_table_and_writes_json_that_adds_up(factory, title, tmp_path, capsys):
    if factory.startswith("llama"):
        pytest.importorskip("transformers")
    out = tmp_path / "explain.json"
    assert main(["explain", f"{MODELS}:{factory}", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"remat explain: {title}: one training step" in text
    assert "region input" in text and "Peak of the step" in text
    data = json.loads(out.read_text())
    assert data["tensors"] and all(FIELDS <= set(row) for row in data["tensors"])
    assert sum(row["bytes"] for row in data["tensors"]) == data["total_bytes"]


def test_all_lists_every_tensor_and_top_the_largest(capsys, tmp_path):
    out = tmp_path / "e.json"
    assert main(["explain", f"{MODELS}:gpt", "--all", "--json", str(out)]) == 0
    every = capsys.readouterr().out
    n = len(json.loads(out.read_text())["tensors"])
    assert main(["explain", f"{MODELS}:gpt", "--top", "2"]) == 0
    two = capsys.readouterr().out
    assert f"the 2 largest of {n}" in two
    assert len(every.splitlines()) == len(two.splitlines()) + n - 2


def test_wrap_checkpoints_the_blocks_first(capsys):
    assert main(["explain", f"{MODELS}:gpt", "--wrap", "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "checkpointed 3 blocks" in text
    assert "region input" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top", "-1"], "--top -1: pass a number of rows >= 1"),
        (["--top", "0"], "--top 0: pass a number of rows >= 1"),  # an empty table: --all or N
        ([f"{MODELS}:gpt", "--model", "mlp"], "--model mlp picks a built-in model"),
        (["--model", "resnet"], "unknown model 'resnet'"),
        (["--json", "/nonexistent/dir/x.json"], "does not exist"),
        (["no_such_module_xyz:make"], "cannot import module 'no_such_module_xyz'"),
        ([f"{MODELS}:LOSSES"], "is not callable"),
    ],
)
def test_usage_mistakes_exit_2_with_one_line(argv, message, capsys):
    assert main(["explain", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat explain: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_model_that_raises_exits_1_with_where(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        raise ValueError('boom')\n"
        "def make():\n"
        "    return M(), (torch.randn(2),)\n"
    )
    assert main(["explain", f"{path}:make"]) == 1
    err = capsys.readouterr().err
    assert "ValueError: boom" in err and "broken.py:4" in err


@pytest.mark.slow
def test_explain_runs_the_builtin_model_without_a_factory(capsys, tmp_path):
    out = tmp_path / "builtin.json"
    assert main(["explain", "--wrap", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "remat explain: built-in gpt" in text and "checkpointed 6 blocks" in text
    data = json.loads(out.read_text())
    assert sum(row["bytes"] for row in data["tensors"]) == data["total_bytes"]


def test_wrap_blocks_picks_the_blocks_to_checkpoint(capsys):
    assert main(["explain", f"{MODELS}:gpt", "--wrap", "--blocks", "blocks.1"]) == 0
    assert "checkpointed 1 blocks" in capsys.readouterr().out


def test_blocks_without_wrap_says_to_add_it(capsys):
    assert main(["explain", f"{MODELS}:gpt", "--blocks", "blocks.*"]) == 2
    assert "picks the blocks --wrap checkpoints: add --wrap" in capsys.readouterr().err
