"""The planner's options checked before any step runs.

Profiling runs training steps that take seconds to minutes; an option that is wrong (a
budget that cannot be read, a ``loss_fn`` that is not callable, a timer misspelt) must
fail at the call, not after the profile, and leave the model untouched.
:func:`remat.auto_checkpoint`, :func:`remat.profile`, the callbacks of
:mod:`remat.integrations` and the CLI check here first; each error starts with the
function's name and names the argument, the value and the fix.

Example:
    >>> check_options("remat.auto_checkpoint", timer="flop")
    Traceback (most recent call last):
    ...
    ValueError: remat.auto_checkpoint: timer must be one of ['time', 'measured', 'flops'], got 'flop'. Pass timer='time' (counted work priced per device), 'measured' (timed steps) or 'flops'.
"""

from __future__ import annotations

import os
from typing import Any, get_args

import torch

from .state import check_step_options
from .stepmodel import check_budget
from .types import Timer

#: The cost measures ``remat.profile`` knows (see its ``timer`` argument).
TIMERS: tuple[Timer, ...] = get_args(Timer)

_UNSET: Any = object()


def check_callable(where: str, name: str, value: object, fix: str) -> None:
    """Raise ``TypeError`` unless ``value`` is callable or ``None``."""
    if value is not None and not callable(value):
        raise TypeError(f"{where}: {name} must be callable or None, got {value!r:.80}. {fix}")


def check_flag(where: str, name: str, value: object, none: bool = False) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False`` (or, with ``none``,
    ``None``): a string ``"False"`` is true, and would be read so."""
    if isinstance(value, bool) or (none and value is None):
        return
    allowed = "True, False or None" if none else "True or False"
    raise TypeError(f"{where}: {name} must be {allowed}, got {value!r:.80}.")


def check_options(
    where: str,
    *,
    budget: Any = _UNSET,
    optimizer: Any = None,
    set_to_none: Any = True,
    loss_fn: Any = None,
    check_fn: Any = None,
    timer: Any = "time",
    distributed: Any = None,
    quiet: Any = False,
    diagnose: Any = False,
    measure: Any = True,
    shapes: Any = None,
    device: Any = None,
    repeats: Any = 1,
    threads: Any = 1,
    calibration: Any = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first option (of those given) that no
    step could use: the arguments of :func:`remat.auto_checkpoint`, :func:`remat.profile`
    and the callbacks, with their defaults. ``budget`` is checked when given (its form:
    a percentage needs the profile to be bytes)."""
    if budget is not _UNSET:
        check_budget(budget, where)
    check_step_options(where, optimizer, set_to_none)
    check_callable(
        where,
        "loss_fn",
        loss_fn,
        "Pass a function of the model's output that returns the scalar loss (or leave it out "
        "for the output's loss, else the sum of its floating outputs).",
    )
    check_callable(
        where,
        "check_fn",
        check_fn,
        "Pass a function (name, module) -> bool that selects the candidate blocks (or leave "
        "it out for the repeated blocks).",
    )
    if not isinstance(timer, str) or timer not in TIMERS:
        raise ValueError(
            f"{where}: timer must be one of {list(TIMERS)}, got {timer!r}. Pass timer='time' "
            "(counted work priced per device), 'measured' (timed steps) or 'flops'."
        )
    check_flag(where, "distributed", distributed, none=True)
    check_flag(where, "quiet", quiet)
    check_flag(where, "diagnose", diagnose)
    check_flag(where, "measure", measure)
    if shapes is not None:
        from .shapes import Shapes  # shapes imports the planner's steps

        if not isinstance(shapes, Shapes):
            raise TypeError(
                f"{where}: shapes must be a remat.Shapes or None, got {shapes!r:.80}. Pass "
                "shapes=remat.Shapes(dims=1) naming the dimension of the inputs that varies."
            )
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"{where}: device must name the device a model on the meta device will train "
                f"on ('cpu', 'cuda', 'cuda:0'), got {device!r:.80}."
            ) from None
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"{where}: repeats must be an int >= 1, got {repeats!r:.80}.")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(
            f"{where}: threads must be an int >= 1 or None, got {threads!r:.80}. Pass 1 (the "
            "steadiest timing), the threads your training uses, or None to keep torch's."
        )
    if calibration is not None and not isinstance(calibration, (str, os.PathLike)):
        raise TypeError(
            f"{where}: calibration must be a device's name or a file saved by "
            f"remat.planner.calibration.save, or None, got {calibration!r:.80}."
        )
