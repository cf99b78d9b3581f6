"""Tests of measurement: remat.memory and remat.measure (explain, diagnose, verify)."""
