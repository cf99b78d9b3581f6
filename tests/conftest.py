"""Shared fixtures."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch


def _pushed() -> tuple[object, int]:
    """The saved-tensor hooks on top of autograd's stack and the torch dispatch modes pushed."""
    return (
        torch._C._autograd._top_saved_tensors_default_hooks(False),
        torch._C._len_torch_dispatch_stack(),
    )


@pytest.fixture(autouse=True)
def nothing_left_pushed() -> Iterator[None]:
    """Every test leaves autograd's saved-tensor hooks and torch's dispatch modes as it found
    them. Something left pushed changes what later tests save, and when it is popped by the
    garbage collector (torch's checkpoint before 2.13 leaves a failed forward's hooks pushed
    in a suspended generator: tests/support/torch_checkpoint.py) it fails out of order in
    whatever runs then, once inside pytest's own report code (an internal error)."""
    before = _pushed()
    yield
    after = _pushed()
    assert after[0] is before[0] and after[1] == before[1], (
        f"the test left saved-tensor hooks or dispatch modes pushed: {before} -> {after}"
    )


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


@pytest.fixture
def fresh_logging_tensor_logger() -> Iterator[None]:
    """torch's ``"LoggingTensor"`` logger as a fresh process has it, put back after the test.

    ``checkpoint(debug=True)`` records operators through it, with records whose arguments
    do not fit their message, so any handler but torch's own fails formatting them ("not
    all arguments converted"); torch's ``capture_logs`` adds its handler, level and filters
    and never puts the level, ``propagate`` or the filters back. What earlier tests or
    libraries left on that logger must not decide a test's verdict.
    """
    logger = logging.getLogger("LoggingTensor")
    saved = (logger.level, logger.propagate, logger.disabled, logger.handlers, logger.filters)
    logger.setLevel(logging.NOTSET)
    logger.propagate, logger.disabled, logger.handlers, logger.filters = True, False, [], []
    try:
        yield
    finally:
        level, logger.propagate, logger.disabled, logger.handlers, logger.filters = saved
        logger.setLevel(level)
