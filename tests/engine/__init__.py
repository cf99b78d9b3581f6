"""Tests of the checkpoint engine (remat.engine): regions, recompute, selective, offload, settings."""
