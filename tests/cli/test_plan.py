"""``remat plan`` (remat.cli.plan): a plan printed and written as the API makes it, and every
mistake in the target, the factory or the values as one line on stderr naming it, with
exit code 2 (usage) or 1 (runtime), and no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.cli import main
from tests.support.cli import one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")


ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_remat_plan_cli_prints_plan_and_writes_json(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        textwrap.dedent(
            """
            from remat.bench.models import ModelConfig, build, example_input

            def make():
                cfg = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)
                return build(cfg), (example_input(cfg),)
            """
        )
    )
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "remat",
            "plan",
            "mymodel:make",
            "--budget",
            "90%",
            "--timer",
            "flops",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ONE_THREAD_ENV,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "blocks.0" in proc.stdout and "predicted step peak" in proc.stdout
    assert "peak in " in proc.stdout  # where the peak falls and its breakdown
    plan = remat.Plan.from_json(out.read_text())
    assert set(plan.decisions) == {"blocks.0", "blocks.1", "blocks.2"}


@pytest.mark.parametrize(
    "flags, optimizer, set_to_none",
    [
        ([], None, True),  # the default loop: no optimizer step, gradients None
        (["--optimizer", "adamw"], "adamw", True),
        (["--optimizer", "sgd-momentum", "--keep-grads"], "sgd-momentum", False),
    ],
)
def test_remat_plan_cli_optimizer_and_keep_grads_plan_the_same_step_as_the_api(
    tmp_path, flags, optimizer, set_to_none
):
    from remat.cli import main

    (tmp_path / "cli_step_model.py").write_text(
        textwrap.dedent(
            """
            from remat.bench.models import ModelConfig, build, example_input

            CFG = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)

            def make():
                return build(CFG), (example_input(CFG),)
            """
        )
    )
    out = tmp_path / "plan.json"
    target = f"{tmp_path / 'cli_step_model.py'}:make"
    argv = ["plan", target, "--budget", "90%", "--timer", "flops", "--json", str(out), *flags]
    assert main(argv) == 0
    from_cli = remat.Plan.from_json(out.read_text())
    cfg = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)
    model = build(cfg)
    opt = {
        None: None,
        "adamw": lambda: torch.optim.AdamW(model.parameters()),
        "sgd-momentum": lambda: torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
    }[optimizer]
    prof = remat.profile(
        model,
        example_input(cfg),
        optimizer=None if opt is None else opt(),
        set_to_none=set_to_none,
        timer="flops",
    )
    assert from_cli == remat.plan(prof, "90%")
    assert (from_cli.breakdown["optimizer"] > 0) == (optimizer is not None)
    if not set_to_none:
        assert from_cli.breakdown["gradients"] == prof.grad_bytes


@pytest.mark.parametrize(
    "target, match",
    [
        ("nomodule:make", "cannot import module 'nomodule'"),
        ("remat:nothing", "has no attribute 'nothing'"),
        ("justaname", "MODULE:FACTORY"),
    ],
)
def test_remat_plan_cli_errors(target, match, capsys):
    # in-process (python -m remat is run once above): exit code 2 and one line naming the mistake
    from remat.cli import main

    assert main(["plan", target, "--budget", "60%"]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


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


# ---------------------------------------------------------------- factory and target mistakes


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
        outs.append(capsys.readouterr().out.replace(str(path), "FILE"))
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


def test_plan_diagnose_applies_the_plan_and_prints_the_probed_warnings(capsys):
    assert main(["plan", "--budget", "60%", "--model", "mlp", "--timer", "flops", "--diagnose"]) == 0
    out = capsys.readouterr().out
    # the built-in MLP's blocks, planned at 60%, checkpoint cleanly: no warning, table intact
    assert "predicted step peak" in out and "warning:" not in out


def test_plan_help_prints_its_example_and_every_default(capsys):
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "remat plan --budget 50%)" in text and "%%" not in text  # argparse's escape, once
    assert "(default: time)" in text  # --timer says its default
    assert "remat.Plan.load(FILE).apply(model)" in text and "--blocks PATTERN" in text


LM = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "explain_models.py")
LM += ":keyword_lm"


def test_plan_header_names_the_unit_of_the_adds_column(capsys):
    assert main(["plan", LM, "--budget", "70%", "--timer", "flops"]) == 0
    text = capsys.readouterr().out
    assert "'adds': its FLOPs" in text and "cost in" not in text
    assert " FLOP\n" in text  # the rows in the unit the header names


def test_blocks_picks_the_blocks_to_plan(capsys):
    argv = ["plan", LM, "--budget", "90%", "--timer", "flops", "--blocks", "blocks.1,blocks.2"]
    assert main(argv) == 0
    rows = capsys.readouterr().out.split("module", 1)[1].splitlines()
    assert [r.split()[0] for r in rows[1:3]] == ["blocks.1", "blocks.2"]
    assert rows[3].startswith("total")


@pytest.mark.parametrize(
    "blocks, text",
    [
        ("", "--blocks '': an empty pattern"),  # checked before the factory runs
        ("layers.*", "--blocks 'layers.*' selects no module of KeywordLM: its repeated blocks "
         "are blocks.0, blocks.1, blocks.2 (--blocks 'blocks.*')"),  # fmt: skip
    ],
)
def test_blocks_that_select_nothing_say_what_would(blocks, text, capsys):
    rc = main(["plan", LM, "--budget", "70%", "--blocks", blocks])
    assert text in one_error_line(capsys.readouterr().err, 2, rc)


def test_a_plan_error_from_the_shell_names_the_flag_not_check_fn(capsys):
    rc = main(["plan", LM, "--budget", "1KiB", "--timer", "flops"])
    err = one_error_line(capsys.readouterr().err, 2, rc)
    assert "no plan keeps the predicted step peak" in err
    assert "--blocks PATTERN" in err and "check_fn" not in err
