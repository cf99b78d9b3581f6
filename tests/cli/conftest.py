"""Fixtures of the command line's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Run where the default output folder (remat-bench/) may be written."""
    monkeypatch.chdir(tmp_path)
