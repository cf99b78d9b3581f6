"""``remat plan`` on a model built on the meta device: planned from shapes (nothing
allocated) for ``--device``, priced with ``--calibration``, a Hugging Face model built from
its config by ``--hf-config``; the output says the scratch inside operators is not counted,
and a flag that does not fit the model is one line naming it (exit code 2)."""

from __future__ import annotations

import json

import pytest
import torch

import remat
from remat.cli import main
from tests.support.cli import one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

#: A Llama of two tiny layers: the 7B shape of docs/BENCHMARKS.md, small.
TINY_LLAMA = json.dumps({
    "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
    "vocab_size": 64, "max_position_embeddings": 64,
})  # fmt: skip

HF = ["--hf-config", TINY_LLAMA, "--batch", "2", "--seq", "16", "--dtype", "bfloat16"]

META_FACTORY = """
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

def make():
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                      max_position_embeddings=64, use_cache=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        ids = torch.zeros(2, 16, dtype=torch.long)
    return model, remat.Inputs(input_ids=ids, labels=ids)
"""

REAL_SEQ = """
import torch

def make():
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]), (torch.randn(2, 8),)
"""


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip(
        "transformers", reason="needs the test extra: pip install -e '.[test]'"
    )


def _calibration_file(path):
    """A saved calibration of a made-up GPU, as ``remat.planner.calibration.save`` writes."""
    constants = {
        "mm_rate": 4e14, "conv_rate": 2e14, "byte_rate": 3e12, "random_rate": 1e12,
        "per_op": 1e-5, "saved_op": 2e-5, "recomputed_op": 2e-5, "region": 5e-5,
        "selective_region": 8e-5, "host_rate": 5e10,
    }  # fmt: skip
    entry = {"key": "v2|cuda|Test GPU|torch.float32", "constants": constants}
    path.write_text(json.dumps({"device": "Test GPU", "entries": {"torch.float32": entry}}))
    return path


def test_hf_config_is_planned_from_shapes_and_says_scratch_is_not_counted(
    transformers, tmp_path, capsys
):
    out = tmp_path / "plan.json"
    args = ["plan", *HF, "--optimizer", "adamw", "--budget", "90%", "--timer", "flops"]
    assert main([*args, "--device", "cuda", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "LlamaForCausalLM from its config on the meta device" in text
    assert "batch 2 x seq 16" in text and "bfloat16" in text
    assert "from shapes" in text and "scratch inside operators" in text
    assert "is not counted" in text and "device cuda" in text
    plan = remat.Plan.from_json(out.read_text())
    assert set(plan.decisions) == {"model.layers.0", "model.layers.1"}
    assert plan.scratch_bytes == 0  # none counted from shapes


def test_a_factory_on_meta_plans_as_hf_config_does(transformers, tmp_path, capsys):
    (tmp_path / "metamodel.py").write_text("import remat\n" + META_FACTORY)
    common = ["--optimizer", "adamw", "--budget", "90%", "--timer", "flops", "--device", "cuda"]
    assert main(["plan", f"{tmp_path / 'metamodel.py'}:make", *common,
                 "--json", str(tmp_path / "a.json")]) == 0  # fmt: skip
    assert main(["plan", *HF, *common, "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a == b
    assert "from shapes" in capsys.readouterr().out


def test_calibration_file_prices_a_plan_for_cuda_without_a_gpu(transformers, tmp_path, capsys):
    saved = _calibration_file(tmp_path / "gpu.json")
    args = ["plan", *HF, "--budget", "90%", "--device", "cuda", "--calibration", str(saved)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"'adds': the time a decision adds to a step priced with calibration {saved}" in text
    assert "cost in s" not in text and " ms" in text  # the unit the table's rows use


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        # --device is for a meta model; the built-in model is on CPU
        (["--device", "cpu"], "--device is for a model on the meta device"),
        # an unknown calibration name is refused before any model is built
        (["--calibration", "no-such-gpu"], "--calibration 'no-such-gpu': calibration must be"),
        # a calibration prices counted work only
        (["--calibration", "x", "--timer", "flops"], "--calibration prices counted work"),
        # the inputs' sizes belong to --hf-config
        (["--seq", "16"], "--seq sizes the inputs of --hf-config"),
        # --hf-config builds the model: no other one with it
        (["--hf-config", "{}", "--seq", "4", "--model", "mlp"], "drop --model mlp"),
        (["--hf-config", "{}"], "--hf-config needs --seq"),
        (["--hf-config", "{not json", "--seq", "4"], "the JSON text does not parse"),
        (["--hf-config", "{}", "--seq", "4"], "with a 'model_type'"),
        (["--hf-config", "no/such/config.json", "--seq", "4"], "no such file"),
    ],
)
def test_a_flag_that_does_not_fit_is_one_line(flags, match, capsys):
    assert main(["plan", "--budget", "50%", *flags]) == 2
    assert match in one_error_line(capsys.readouterr().err, 2, 2)


def test_device_with_a_model_on_its_device_is_one_line(tmp_path, capsys):
    (tmp_path / "real.py").write_text(REAL_SEQ)
    rc = main(["plan", f"{tmp_path / 'real.py'}:make", "--budget", "50%", "--device", "cuda"])
    line = one_error_line(capsys.readouterr().err, 2, rc)
    assert "--device is for a model on the meta device" in line and "on cpu" in line


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--autocast", "bfloat16"], "--autocast runs real steps"),
        (["--timer", "measured"], "--timer measured runs real steps"),
        (["--diagnose"], "--diagnose runs real steps"),
    ],
)
def test_a_flag_that_runs_real_steps_is_refused_for_a_meta_model(
    transformers, flags, match, capsys
):
    assert main(["plan", *HF, "--budget", "50%", *flags]) == 2
    assert match in one_error_line(capsys.readouterr().err, 2, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can calibrate its GPU")
def test_cuda_without_a_gpu_or_a_calibration_names_what_to_pass(transformers, capsys):
    assert main(["plan", *HF, "--budget", "50%", "--device", "cuda"]) == 2
    line = one_error_line(capsys.readouterr().err, 2, 2)
    assert "pass --calibration NAME_OR_FILE" in line and "--timer flops" in line
