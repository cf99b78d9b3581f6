"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tests, the previous count put back after them.

    On the shared 2-core machine two threads make each small step far slower (tiny ops
    on two threads wait for each other; a planner module took ~100x longer); bytes do not
    depend on the thread count. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
