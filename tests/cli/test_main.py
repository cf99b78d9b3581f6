"""The ``remat`` command itself (remat.cli.main): argparse's exits returned as codes, Ctrl-C,
help and version.
"""

from __future__ import annotations

import sys

import pytest
import torch

import remat as remat_pkg
from remat.cli import bench as bench_cli
from remat.cli import main
from tests.support.cli import interrupted, one_error_line

TINY_BENCH = ["bench", "--quick", "--steps", "1", "--no-progress"]



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


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "_main", interrupted)
    rc = main(TINY_BENCH)
    assert one_error_line(capsys.readouterr().err, 130, rc) == "remat bench: interrupted"


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().err


def test_version_names_remat_and_torch(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"remat {remat_pkg.__version__} (torch {torch.__version__}, Python "
        f"{sys.version.split()[0]})"
    )
