"""The `remat` command line: `remat bench` end to end in a subprocess, and its errors."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import remat as remat_pkg
from remat.cli import main

SRC = str(pathlib.Path(remat_pkg.__file__).resolve().parent.parent)

TINY = ["--quick", "--steps", "1", "--no-progress"]


def remat(*args, cwd, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "remat", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Run where the default output folder (remat-bench/) may be written."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """A default-output run: ``(json data, stdout, folder)``."""
    cwd = tmp_path_factory.mktemp("bench")
    proc = remat("bench", *TINY, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads((cwd / "remat-bench" / "bench.json").read_text()), proc.stdout, cwd


@pytest.fixture(scope="module")
def bench_json(bench_run):
    return bench_run[0], bench_run[1]


def test_bench_json_has_environment_and_rows(bench_json):
    data, _ = bench_json
    env = data["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert env["model"]["layers"] == 4 and env["parameters"] > 0
    fields = {
        "strategy",
        "description",
        "peak_bytes",
        "activation_bytes",
        "step_time_s",
        "memory_ratio",
        "activation_ratio",
        "time_ratio",
        "max_grad_diff",
        "step_times_s",
        "time_ratios",
        "time_ratio_low",
        "time_ratio_high",
        "ties",
        "details",
    }
    for row in data["rows"]:
        assert fields <= set(row)
        assert len(row["step_times_s"]) == 1  # --steps 1: every timed step is kept
    names = [r["strategy"] for r in data["rows"]]
    assert names[0] == "none"
    assert names == [
        "none",
        "full",
        "every-2nd",
        "selective",
        "torch-full",
        "torch-selective",
        "auto-30%",
        "auto-50%",
        "auto-70%",
    ]
    assert [s["strategy"] for s in data["skipped"]] == ["offload", "offload-blocks"]
    assert data["timing"]["threads"] == 1 and data["timing"]["clock"] == "cpu"
    assert data["recommendation"]["text"].startswith("Recommendation: ")
    assert data["outputs"]["json"].endswith("bench.json")


def test_bench_reference_is_none_with_ratio_one(bench_json):
    rows = {r["strategy"]: r for r in bench_json[0]["rows"]}
    none = rows["none"]
    assert (
        none["memory_ratio"] == 1.0
        and none["activation_ratio"] == 1.0
        and none["time_ratio"] == 1.0
    )


def test_bench_full_checkpointing_halves_activations_with_exact_grads(bench_json):
    rows = {r["strategy"]: r for r in bench_json[0]["rows"]}
    assert rows["full"]["activation_ratio"] < 0.5
    for r in rows.values():
        assert r["max_grad_diff"] == 0.0, r["strategy"]


def test_bench_remat_selective_keeps_no_more_than_torch_selective(bench_json):
    rows = {r["strategy"]: r for r in bench_json[0]["rows"]}
    # same op list; remat frees cached outputs as torch does (within allocator noise)
    assert (
        rows["selective"]["activation_bytes"] <= rows["torch-selective"]["activation_bytes"] + 4096
    )


def test_bench_prints_header_estimate_table_recommendation_and_paths(bench_run):
    data, out, cwd = bench_run
    assert "remat bench: torch" in out and "strategy" in out and "torch-full" in out
    assert "estimated time: about" in out  # said up front, before the table
    assert out.index("estimated time") < out.index("strategy ")
    assert "skipped on cpu: offload, offload-blocks (needs a device" in out  # said, not silent
    assert data["recommendation"]["text"] in out
    assert data["noise"]["text"] in out
    wrote = out.strip().splitlines()[-1]
    has_plot = (cwd / "remat-bench" / "bench.png").exists()
    expected = "wrote " + os.path.join("remat-bench", "bench.json")
    if has_plot:
        expected += " and " + os.path.join("remat-bench", "bench.png")
    assert wrote == expected


def test_bench_auto_rows_carry_their_plans(bench_json):
    rows = {r["strategy"]: r for r in bench_json[0]["rows"]}
    for pct in (30, 50, 70):
        details = rows[f"auto-{pct}%"]["details"]
        assert details["budget"] == f"{pct}%"
        assert set(details["plan"]["decisions"]) == {f"blocks.{i}" for i in range(4)}
    notes = {f["strategy"] for f in bench_json[0]["footnotes"]}
    assert notes == {n for n, r in rows.items() if r["details"].get("note")}


# Error cases run in-process (``main(argv)`` is what the console script calls): each
# fails before any benchmark work, so a subprocess would only add torch's import time.
@pytest.mark.parametrize(
    "args, message",
    [
        # a typo in a strategy: the valid names are listed
        (["--strategies", "full,bogus"], "unknown strategy 'bogus'; choose from:"),
        # an unknown model: the valid names are listed
        (["--model", "resnet"], "unknown model 'resnet'; choose one of: gpt, mlp"),
        # a nonsensical count
        (["--steps", "0"], "--steps must be >= 1"),
        # a size that cannot fit: says roughly how much it needs
        (["--batch", "100000", "--seq", "100000"], "needs roughly"),
        # offload on a CPU-only setup: refused with the reason
        (["--device", "cpu", "--strategies", "offload"], "needs a device"),
    ],
)
def test_bench_usage_errors_exit_2_with_a_message(args, message, capsys):
    assert main(["bench", *TINY, *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_bench_cuda_without_cuda_says_so(capsys):
    assert main(["bench", *TINY, "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bench_list_names_every_strategy(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("none", "full", "every-2nd", "selective", "offload", "torch-full"):
        assert name in out


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if remat[plot] were not installed
    assert main(["bench", *TINY, "--plot", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "pip install 'remat[plot]'" in captured.err
    assert "strategy" not in captured.out  # failed up front: nothing was run


def test_without_matplotlib_the_default_run_still_writes_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if remat[plot] were not installed
    assert main(["bench", *TINY, "--layers", "1", "--strategies", "full"]) == 0
    out = capsys.readouterr().out
    assert "picture skipped: matplotlib is not installed (pip install 'remat[plot]')" in out
    assert (tmp_path / "remat-bench" / "bench.json").exists()
    assert not (tmp_path / "remat-bench" / "bench.png").exists()
    assert out.strip().splitlines()[-1] == "wrote " + os.path.join("remat-bench", "bench.json")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (remat[plot]) is not installed")
    png = tmp_path / "bench.png"
    proc = remat("bench", *TINY, "--strategies", "full", "--plot", str(png), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "remat-bench" / "bench.json").exists()  # the JSON goes to --out


def test_no_save_writes_nothing(tmp_path, capsys):
    assert main(["bench", *TINY, "--layers", "1", "--strategies", "full", "--no-save"]) == 0
    assert not list(tmp_path.iterdir())
    assert "wrote" not in capsys.readouterr().out


def test_version_names_remat_and_torch(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"remat {remat_pkg.__version__} (torch {torch.__version__}, Python "
        f"{sys.version.split()[0]})"
    )


@pytest.mark.parametrize("budget", ["-5%", "-5", "-1GiB"])
def test_negative_budget_gets_remats_error_not_argparses(budget, capsys):
    assert main(["plan", "--budget", budget, "--timer", "flops"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"remat plan: error: --budget '{budget}': ")
    assert "expected one argument" not in err


def test_plan_profiles_the_builtin_model_without_a_factory(capsys):
    assert main(["plan", "--budget", "60%", "--model", "mlp", "--timer", "flops"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("remat plan: built-in mlp (6 layers, d=256, seq 128, batch 4)")
    assert "blocks.5" in out and "predicted step peak" in out


def test_plan_model_flag_is_for_the_builtin_model_only(capsys):
    assert main(["plan", "pkg:make", "--model", "gpt", "--budget", "60%"]) == 2
    assert "--model gpt picks a built-in model" in capsys.readouterr().err


SMALL = """
import torch

def make():
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                  torch.nn.Linear(128, 32)) for _ in range(3)]
    return torch.nn.Sequential(*blocks), (torch.randn(512, 32),)
"""


def test_plan_autocast_plans_the_mixed_precision_recipe(tmp_path, capsys):
    # the bf16 step holds half-precision weight copies in forward: another unchecked peak
    (tmp_path / "small.py").write_text(SMALL)
    target = f"{tmp_path / 'small.py'}:make"
    args = ["plan", target, "--budget", "60%", "--timer", "flops"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--autocast", "bfloat16"]) == 0
    amp = capsys.readouterr().out
    assert "predicted step peak" in amp
    peak = [line for line in amp.splitlines() if "unchecked step peak" in line]
    assert peak and peak != [line for line in plain.splitlines() if "unchecked step peak" in line]
    assert not torch.is_autocast_enabled("cpu")  # the region ended with the command
