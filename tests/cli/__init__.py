"""Tests of the ``remat`` command line (remat.cli)."""

from __future__ import annotations


