"""torch's own checkpoint in the tests that compare with it, where its forward may raise.

torch before 2.13 (pytorch/pytorch#184018 is in 2.13, not in 2.11) runs a non-reentrant
checkpoint's forward between two steps of a generator that pushed its saved-tensor hooks
and the ``context_fn`` forward context; when the forward raises, the generator is left
suspended, those hooks and modes stay pushed, and they are popped only when the garbage
collector finalizes the generator, out of order ("trying to pop from empty mode stack",
an internal assert of autograd's hook stack), in whatever test runs then. Since 2.13 torch
throws the exception into the generator, which pops them at once.

:func:`close_failed_forward` does what torch 2.13 does, for an exception torch's checkpoint
let through: it closes the generator that the exception's traceback holds, so the hooks and
modes are popped in order at once. :func:`checkpoint` is ``torch.utils.checkpoint.checkpoint``
with that on a failure; the exception itself is unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.utils.checkpoint as tuc

_CHECKPOINT_CODE = inspect.unwrap(tuc.checkpoint).__code__


def close_failed_forward(error: BaseException) -> None:
    """Close the suspended generators of torch's checkpoint calls ``error`` went through
    (innermost first); nothing on a torch that closed them itself."""
    gens = []
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is _CHECKPOINT_CODE:
            gen = frame.f_locals.get("gen")
            if gen is not None and inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED:
                gens.append(gen)
        tb = tb.tb_next
    for gen in reversed(gens):
        gen.close()


def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint``; a failed forward leaves nothing pushed."""
    try:
        return tuc.checkpoint(function, *args, **kwargs)
    except BaseException as e:
        close_failed_forward(e)
        raise


class _Failed(Exception):
    pass


class _Suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return True


def _fails(x: Any) -> Any:
    raise _Failed


def rejects_a_suppressing_forward_context() -> bool:
    """Whether torch's checkpoint raises its own RuntimeError ("suppressed an exception")
    when ``context_fn``'s forward context suppresses the forward's exception: torch 2.13
    (pytorch/pytorch#184018); before, the forward's exception itself goes through."""
    import torch

    x = torch.zeros(1, requires_grad=True)
    try:
        checkpoint(_fails, x, use_reentrant=False, context_fn=lambda: (_Suppress(), _Suppress()))
    except _Failed:
        return False
    except RuntimeError as e:
        return "suppressed an exception" in str(e)
    return False
