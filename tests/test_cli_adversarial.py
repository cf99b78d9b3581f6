"""Adversarial use of the `remat` command line: every bad input is one line on stderr
naming the argument, with exit code 2 (usage) or 1 (runtime), and no traceback.

In-process through ``remat.cli.main(argv)`` (what the console script calls); the
error cases fail before any benchmark or profiling work.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

import remat
from remat.cli import bench as bench_cli
from remat.cli import main

TINY = ["bench", "--quick", "--steps", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Run where the default output folder (remat-bench/) may be written."""
    monkeypatch.chdir(tmp_path)

FACTORIES = """
import torch
from torch import nn

CALLS = []


def good():
    CALLS.append("good")
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3)]
    return nn.Sequential(*blocks), (torch.randn(256, 8),)


def raises():
    CALLS.append("raises")
    raise RuntimeError("boom in the factory")


def needs_arg(x):
    return good()


def as_list():
    return list(good())


def triple():
    return (*good(), 1)


def not_a_module():
    return (lambda x: x), (torch.randn(2),)


def args_as_list():
    model, args = good()
    return model, list(args)


NOT_CALLABLE = 5
"""


def one_error_line(err: str, exit_code: int, rc: int) -> str:
    assert rc == exit_code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def factories(tmp_path):
    """A factory file, and sys.path/sys.modules put back as they were afterwards."""
    path = tmp_path / "cli_adv_factories.py"
    path.write_text(FACTORIES)
    (tmp_path / "cli_adv_broken.py").write_text("def f(:\n")
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    yield str(path)
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        del sys.modules[name]


# ---------------------------------------------------------------- remat itself


@pytest.mark.parametrize(
    "argv, code, stream, text",
    [
        # argparse's own errors are returned, not raised as SystemExit
        (["nope"], 2, "err", "invalid choice: 'nope'"),
        (["bench", "--layers", "abc"], 2, "err", "argument --layers: invalid int value: 'abc'"),
        (["plan", "m:f"], 2, "err", "required: --budget"),
        (["--help"], 0, "out", "bench"),
        (["bench", "--help"], 0, "out", "wins over it"),  # --quick vs explicit sizes, documented
        (["plan", "--help"], 0, "out", "models.py:make_model"),  # a file path is supported
    ],
)
def test_argparse_exits_are_returned_as_codes(argv, code, stream, text, capsys):
    assert main(argv) == code
    assert text in " ".join(getattr(capsys.readouterr(), stream).split())


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "_main", interrupted)
    rc = main(TINY)
    assert one_error_line(capsys.readouterr().err, 130, rc) == "remat bench: interrupted"


# ---------------------------------------------------------------- remat bench


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
    rc = main([*TINY, *args])
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
    argv = [*TINY, "--layers", "1", "--strategies", " full, ,full ", "--json", str(out)]
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
    rc = main([*TINY, "--layers", "1", "--strategies", "none", "--json", str(out)])
    line = one_error_line(capsys.readouterr().err, 1, rc)
    assert line == f"remat bench: error: --json {out}: cannot write it: Permission denied."


def test_bench_threads_are_put_back_after_the_run(monkeypatch):
    # main(argv) in-process left torch's thread count changed for the rest of the process
    before = torch.get_num_threads()
    threads = 1 if before != 1 else min(2, os.cpu_count() or 1)
    monkeypatch.setattr(bench_cli, "_count", interrupted)  # stop after --threads is applied
    assert main([*TINY, "--threads", str(threads)]) == 130
    assert torch.get_num_threads() == before


# ---------------------------------------------------------------- remat plan


@pytest.mark.parametrize(
    "attr, code, text",
    [
        # the factory raising: a runtime error, with where it was raised
        (
            "raises",
            1,
            "cli_adv_factories.py:raises() raised RuntimeError: boom in the factory (at ",
        ),
        # not a function, or not callable without arguments: a traceback before
        ("NOT_CALLABLE", 2, "is not callable (got int)"),
        ("needs_arg", 2, "cannot be called without arguments"),
        # the wrong shape of result
        ("as_list", 2, "must return a pair (model, example_args), got list"),
        ("triple", 2, "got a tuple of 3 items"),
        ("not_a_module", 2, "with model an nn.Module, got a function first"),
        # a list of args is the model's only argument: the model fails, the hint says why
        ("args_as_list", 1, "returned example_args that is not a tuple"),
        ("missing", 2, "has no attribute 'missing'"),
    ],
)
def test_plan_factory_mistakes(factories, attr, code, text, capsys):
    rc = main(["plan", f"{factories}:{attr}", "--budget", "60%", "--timer", "flops"])
    line = one_error_line(capsys.readouterr().err, code, rc)
    assert line.startswith("remat plan: error: ") and text in line


@pytest.mark.parametrize(
    "target, code, text",
    [
        ("{dir}/nofile.py:good", 2, "no file"),
        ("{dir}/cli_adv_factories.py:", 2, "expected MODULE:FACTORY"),
        (":good", 2, "expected MODULE:FACTORY"),  # was "Empty module name"
        ("./{rel}:good", 0, ""),  # a relative file path raised TypeError
        ("{dir}/cli_adv_broken.py:f", 1, "raised SyntaxError: invalid syntax"),
    ],
)
def test_plan_targets(factories, target, code, text, monkeypatch, capsys):
    d = os.path.dirname(factories)
    monkeypatch.chdir(os.path.dirname(d))
    target = target.format(dir=d, rel=os.path.join(os.path.basename(d), "cli_adv_factories.py"))
    rc = main(["plan", target, "--budget", "60%", "--timer", "flops"])
    if code == 0:
        assert rc == 0 and "predicted step peak" in capsys.readouterr().out
    else:
        assert text in one_error_line(capsys.readouterr().err, code, rc)


def test_plan_module_with_a_syntax_error_exits_1(factories, monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.dirname(factories))
    rc = main(["plan", "cli_adv_broken:f", "--budget", "60%"])
    line = one_error_line(capsys.readouterr().err, 1, rc)
    assert "importing cli_adv_broken raised SyntaxError" in line


@pytest.mark.parametrize(
    "args, text",
    [
        (["--budget", "abc"], "--budget 'abc': cannot read budget"),
        (["--budget", "0%"], "--budget '0%': budget percentage must be above 0%"),
        (["--budget", "-5"], "--budget '-5': budget must be >= 1 byte"),
        (["--budget", "60%", "--json", "{tmp}"], "--json {tmp}: is a directory"),
    ],
)
def test_plan_bad_values_fail_before_the_factory_runs(factories, args, text, tmp_path, capsys):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    rc = main(["plan", f"{factories}:raises", *args])  # the factory would exit 1
    line = one_error_line(capsys.readouterr().err, 2, rc)
    assert text.replace("{tmp}", str(tmp_path)) in line


def test_plan_milp_without_scipy_names_the_extra_up_front(factories, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "scipy", None)  # as if remat[plan] were not installed
    rc = main(["plan", f"{factories}:raises", "--budget", "60%", "--solver", "milp"])
    line = one_error_line(capsys.readouterr().err, 2, rc)
    assert "pip install 'remat[plan]' (or pass --solver dp)" in line


def test_plan_file_target_json_reads_back_and_solvers_agree(factories, tmp_path, capsys):
    solvers = ["dp", "dp", "milp"] if _has_scipy() else ["dp", "dp"]
    outs, plans = [], []
    for k, solver in enumerate(solvers):
        path = tmp_path / f"{k}.json"
        argv = ["plan", f"{factories}:good", "--budget", "70%", "--timer", "flops"]
        per_block = ["--no-spans"] if solver == "dp" else []  # milp plans per block
        assert main([*argv, "--solver", solver, *per_block, "--json", str(path)]) == 0
        outs.append(capsys.readouterr().out)
        plans.append(remat.Plan.from_json(path.read_text()))
    assert outs[0] == outs[1] and plans[0] == plans[1]  # flops: the same output every run
    assert "unchecked step peak 263.51 KiB (before it starts: 14.47 KiB" in outs[0]  # was "0.00 MiB"
    assert set(plans[0].decisions) == {"0", "1", "2"}
    # both solvers are exact and break ties the same way: the same plan
    costs = {(p.predicted_overhead_s, p.predicted_peak_bytes, p.budget_bytes) for p in plans}
    assert len(costs) == 1
    assert all(p.decisions == plans[0].decisions for p in plans)


def _has_scipy() -> bool:
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return False
    return True


def test_describe_points_at_user_code_not_torch():
    from remat.cli._usage import describe

    def user_code():
        return torch.nn.Linear(2, 2)(torch.randn(3, 5))

    try:
        user_code()
    except RuntimeError as e:
        text = describe(e)
    assert text.startswith("RuntimeError: mat1 and mat2") and __file__ in text
    assert textwrap.shorten(text, 10_000) == text  # one line
