"""Doctest collection of src/remat: the integration modules whose framework (an optional
extra) is not installed are not collected (importing them raises, naming the extra); the
calibration cache of the whole session; one intra-op thread in each pytest-xdist worker."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    # ``-n 2`` on two cores: two workers of two intra-op threads each wait for each other
    # (the default run took 6.2 min so against 3.3 min with one thread each). Bytes do not
    # depend on the thread count; subprocesses a test starts keep torch's default.
    torch.set_num_threads(1)

collect_ignore: list[str] = []
if importlib.util.find_spec("transformers") is None:
    collect_ignore += [
        "src/remat/integrations/hf.py",
        "src/remat/integrations/_hf_layers.py",
        "src/remat/integrations/_hf_trainer.py",
    ]
if importlib.util.find_spec("lightning") is None:
    collect_ignore += ["src/remat/integrations/lightning.py"]


@pytest.fixture(scope="session", autouse=True)
def calibration_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The planner's device calibration (remat.planner.calibration) kept in a directory of
    the test session, not the user's cache; put back after the session."""
    old = os.environ.get("REMAT_CACHE_DIR")
    os.environ["REMAT_CACHE_DIR"] = str(tmp_path_factory.mktemp("remat-cache"))
    try:
        yield
    finally:
        if old is None:
            del os.environ["REMAT_CACHE_DIR"]
        else:
            os.environ["REMAT_CACHE_DIR"] = old
