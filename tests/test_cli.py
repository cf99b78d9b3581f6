"""The `remat` command line: `remat bench` end to end in a subprocess, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from remat.cli import main

TINY = ["--quick", "--steps", "1", "--no-progress"]


def remat(*args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "remat", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out.json"
    proc = remat("bench", *TINY, "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


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
    }
    for row in data["rows"]:
        assert fields <= set(row)
        assert len(row["step_times_s"]) == 1  # --steps 1: every timed step is kept
    names = [r["strategy"] for r in data["rows"]]
    assert names[0] == "none"
    assert {
        "full",
        "every-2nd",
        "selective",
        "torch-full",
        "torch-selective",
        "torch-wrapper",
    } <= set(names)
    assert "offload" not in names  # device only


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


def test_bench_prints_header_and_table(bench_json):
    out = bench_json[1]
    assert "remat bench: torch" in out and "strategy" in out and "torch-wrapper" in out
    assert "skipped on cpu: offload, offload-blocks (needs a device" in out  # said, not silent


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


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (remat[plot]) is not installed")
    png = tmp_path / "bench.png"
    proc = remat("bench", *TINY, "--strategies", "full", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
