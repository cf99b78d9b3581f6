"""The caller's ``torch.autocast`` region in the planner's steps: torch's mixed-precision recipe.

The training loop of torch's automatic mixed precision recipe is::

    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
        loss = loss_fn(out)
    loss.backward()                 # outside the region
    optimizer.step()

While the region is open, autocast keeps every weight it casts in its cast
cache (the half-precision copy of each float32 parameter, made on first use),
and it drops the cache when the region ends, before backward. Backward runs
without autocast; a checkpoint's recompute then opens its own region, whose
casts are dropped when the recompute returns.

To plan that loop, call :func:`remat.profile`, :func:`remat.measure_peak` or
:func:`remat.auto_checkpoint` inside the region, as the loop calls the model.
Every step they run then models one iteration of the loop:

* the step starts with an empty cast cache (a fresh region each iteration;
  without this the casts of the first step would be reused by the later ones,
  whose peaks would lack them);
* forward and the loss run under the caller's autocast;
* backward and ``optimizer.step()`` run as after the region's end: the cache
  dropped, autocast off, no region open (:func:`outside`).

A loop that calls ``backward()`` inside the region (torch advises against it)
keeps the casts alive through backward, and runs the backward's operators
under autocast: that loop is not what these steps measure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..engine.state import autocast_types


def caller_autocast() -> bool:
    """Whether an autocast region is open and enabled for some device type here."""
    return bool(torch._C._is_any_autocast_enabled())


def fresh_region() -> None:
    """A step's start inside the caller's region: the cast cache empty, as in a new region."""
    if caller_autocast():
        torch.clear_autocast_cache()


@contextlib.contextmanager
def outside() -> Iterator[None]:
    """Run the block as if the caller's autocast regions had ended (backward of the recipe).

    The cast cache is dropped (through ``torch.clear_autocast_cache``, as the region's
    exit does), autocast is off for every device type and the regions' nesting count
    is zero, so that a recompute's own region drops its casts when it returns. All of it
    is put back afterwards, exceptions included; the cache starts empty again.
    """
    if not caller_autocast():
        yield
        return
    types = autocast_types()
    enabled = [(t, torch.is_autocast_enabled(t)) for t in types]
    depth = 0
    try:
        while torch.autocast_increment_nesting() > 1:  # count the open regions: n + 1 > 1
            torch.autocast_decrement_nesting()
            torch.autocast_decrement_nesting()
            depth += 1
        torch.autocast_decrement_nesting()
        torch.clear_autocast_cache()
        for t, on in enabled:
            if on:
                torch.set_autocast_enabled(t, False)
        yield
    finally:
        for t, on in enabled:
            torch.set_autocast_enabled(t, on)
        for _ in range(depth):
            torch.autocast_increment_nesting()
        torch.clear_autocast_cache()
