"""Shared fixtures."""

from __future__ import annotations

import logging
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
