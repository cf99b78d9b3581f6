"""``remat bench`` (remat.cli.bench): end to end in a subprocess, and in-process through
``remat.cli.main(argv)``, where every bad input is one line on stderr naming the argument,
with exit code 2 (usage) or 1 (runtime), and no traceback.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import remat as remat_pkg
from remat.bench.strategies import DEEP
from remat.cli import bench as bench_cli
from remat.cli import main
from tests.support.cli import interrupted, one_error_line

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
    assert data["recommendation"]["text"].startswith("Recommendation (the fastest at each memory")
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


# ---------------------------------------------------------------- bad input, in-process


@pytest.mark.parametrize(
    "args, text",
    [
        # an empty list ran only the reference, silently
        (["--strategies", ""], "--strategies '' names no strategy"),
        (["--strategies", " , ,"], "--strategies ' , ,' names no strategy"),
        # the argument is named in each message
        (["--model", "MLP"], "--model: unknown model 'MLP'"),
        (["--device", "foo"], "--device: unknown device 'foo'"),
        (["--strategies", "full,nope"], "--strategies: unknown strategy 'nope'"),
        # far more threads than CPUs crashed torch (a segfault at 10000)
        (["--threads", str((os.cpu_count() or 1) + 1)], "--threads must be between 1 and"),
        (["--threads", "0"], "--threads must be between 1 and"),
        # a directory or a missing folder failed with a traceback after the whole run
        (["--json", "{tmp}"], "is a directory"),
        (["--json", "{tmp}/missing/out.json"], "does not exist"),
        (["--json", ""], "--json '': empty file name"),
        # matplotlib raised after the run (.txt) or wrote FILE.png but reported FILE
        (["--plot", "{tmp}/plot.txt"], "must end in .png, .pdf, .svg"),
        (["--plot", "{tmp}/plot"], "must end in .png, .pdf, .svg"),
        (["--plot", "{tmp}/missing/plot.png"], "does not exist"),
    ],
)
def test_bench_bad_values_fail_up_front_naming_the_argument(args, text, tmp_path, capsys):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    rc = main(["bench", *TINY, *args])
    line = one_error_line(capsys.readouterr().err, 2, rc)
    assert line.startswith("remat bench: error: ") and text in line
    assert not list(tmp_path.iterdir())  # nothing written


def test_bench_cuda_index_beyond_the_devices_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(bench_cli.UsageError, match=r"--device cuda:3: there is 1 CUDA device"):
        bench_cli._device("cuda:3")
    with pytest.raises(bench_cli.UsageError, match="only cpu and cuda"):
        bench_cli._device("meta")
    assert bench_cli._device("cuda:0") == torch.device("cuda", 0)


def test_bench_repeated_strategy_runs_once_with_exact_gradients(tmp_path, capsys):
    # "full,full" shared one model between two rows: its gradients doubled (max |dgrad| > 0)
    out = tmp_path / "out.json"
    argv = ["bench", *TINY, "--layers", "1", "--strategies", " full, ,full ", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["none", "full"]
    assert [r["max_grad_diff"] for r in rows] == [0.0, 0.0]
    assert ", 4 heads," in capsys.readouterr().out  # gpt's heads are shown


def test_bench_runner_refuses_repeated_strategy_names():
    from remat.bench.models import ModelConfig
    from remat.bench.runner import run
    from remat.bench.strategies import registry

    full = registry()["full"]
    with pytest.raises(ValueError, match=r"unique, got \['full'\]"):
        run(ModelConfig(layers=1), [full, full], device=torch.device("cpu"), steps=1)


def test_bench_json_write_failure_after_the_run_exits_1(monkeypatch, tmp_path, capsys):
    from remat.cli import _usage

    def fail(*a, **k):
        raise PermissionError(13, "Permission denied")

    out = tmp_path / "out.json"
    monkeypatch.setattr(bench_cli, "check_output_path", lambda flag, path: None)
    monkeypatch.setattr(_usage, "open", fail, raising=False)
    rc = main(["bench", *TINY, "--layers", "1", "--strategies", "none", "--json", str(out)])
    line = one_error_line(capsys.readouterr().err, 1, rc)
    assert line == f"remat bench: error: --json {out}: cannot write it: Permission denied."


def test_bench_threads_are_put_back_after_the_run(monkeypatch):
    # main(argv) in-process left torch's thread count changed for the rest of the process
    before = torch.get_num_threads()
    threads = 1 if before != 1 else min(2, os.cpu_count() or 1)
    monkeypatch.setattr(bench_cli, "_count", interrupted)  # stop after --threads is applied
    assert main(["bench", *TINY, "--threads", str(threads)]) == 130
    assert torch.get_num_threads() == before


def test_deep_preset_runs_the_floor_comparison_by_default():
    from remat.cli.bench import _strategies

    chosen, skipped = _strategies(None, torch.device("cpu"), "deep")
    assert [s.name for s in chosen] == list(DEEP) and skipped == []
    assert "torch-2nd" in DEEP and any(n.startswith("auto-floor-") for n in DEEP)


def test_bench_help_says_each_size_once_with_its_duration_and_machine(capsys):
    assert main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("and every strategy", "plans below the floor", "a smoke test"):
        assert text.count(phrase) == 1, phrase  # was said in the description and again
    for size in ("quick", "large", "deep"):
        option = text.split(f"--{size} ", 2)[-1].split(" --", 1)[0]  # the option's own help
        assert option.count("about ") == 1, option
    assert "on a quiet 2-core AMD EPYC CPU" in text
