"""Tests of remat: the tree mirrors src/remat/; shared models and helpers are in tests/support."""
