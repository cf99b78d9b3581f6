"""Tests of remat.integrations: Hugging Face, Lightning, the actual-step check."""
