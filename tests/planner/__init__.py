"""Tests of remat.planner: measure, step model, solvers, apply, auto_checkpoint, and whole model families."""

from __future__ import annotations


