"""Tests of remat.bench: models, strategies, runner, statistics, report, picture."""

from __future__ import annotations


