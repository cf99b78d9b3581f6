"""Tests of the module level (remat.modules): wrappers, splits, spans, blocks, model facts."""
