"""The model's inputs, apart from the planner's options.

:func:`remat.profile`, :func:`remat.auto_checkpoint` and :func:`remat.measure_peak` take
the model's inputs as ``*args, **kwargs`` beside their own keyword options (``budget``,
``optimizer``, ``timer``, ...). A model whose ``forward`` takes a keyword named like one of
those options passes its inputs as one :class:`Inputs` instead: every option keyword then
belongs to the planner, every input to the model.
"""

from __future__ import annotations

from typing import Any


class Inputs:
    """A model's positional and keyword inputs, passed to the planner as one argument.

    Example:
        >>> import torch, remat
        >>> class Scaled(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        ...     def forward(self, x, timer=1.0):  # a keyword named like a planner option
        ...         return self.layers(x) * timer
        >>> model, x = Scaled(), torch.randn(4, 8)
        >>> plan = remat.auto_checkpoint(model, remat.Inputs(x, timer=2.0), budget="100%",
        ...                              timer="flops")
        >>> remat.measure_peak(model, remat.Inputs(x, timer=2.0)) <= plan.budget_bytes
        True
    """

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"Inputs({', '.join(parts)})"


def model_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], where: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's ``(args, kwargs)``: those of an :class:`Inputs` passed alone, else as
    given."""
    if not any(isinstance(a, Inputs) for a in args):
        return args, kwargs
    if len(args) != 1 or kwargs:
        raise TypeError(
            f"{where}: an Inputs must hold all of the model's inputs, got it beside "
            f"{len(args) - 1} more positional and {len(kwargs)} keyword inputs "
            f"({sorted(kwargs)}). Pass remat.Inputs(*args, **kwargs) alone after the model."
        )
    return args[0].args, dict(args[0].kwargs)
