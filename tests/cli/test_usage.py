"""What every subcommand shares (remat.cli._usage): errors described at the user's code."""

from __future__ import annotations

import textwrap

import torch


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
