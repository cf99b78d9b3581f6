"""Regional compilation: a block's forward compiled on its own, at a partitioner budget.

Under ``torch.compile`` the min-cut partitioner decides what a graph saves for backward and
what its backward recomputes, within an *activation memory budget*
(``torch._functorch.config.activation_memory_budget``): ``1.0`` saves what is fastest, ``0.0``
as little as recomputing the whole graph needs, values between solve a knapsack. One budget
holds per graph, a share of that graph's activations, not bytes of a step. Compiling each
block on its own gives one graph per block, so the planner chooses a budget per block for a
byte budget of the whole step (:mod:`remat.planner.compiled` measures such steps), as it
chooses decisions in eager mode: under ``compile=True`` a decision means the budget
:data:`LEVELS` gives it.

:func:`compile_block` puts an instance-level ``forward`` on the block (as
:func:`remat.checkpoint_wrapper` does; the block's hooks, parameters and ``state_dict`` keys
stay as they are) that calls the block's class ``forward`` through a function compiled for
that budget. Each budget has a code object of its own (:func:`_level_function`):
``torch.compile`` caches compiled frames per code object, so each level compiles its own
graphs, shared by every block of one class and input shapes (the compile cost is per class
and level, not per block), and the budget is read as the graph compiles.

Example:
    >>> import torch
    >>> from remat.planner.regional import compile_block, compiled_level, uncompile
    >>> lin = torch.nn.Linear(4, 4)
    >>> compile_block(lin, 0.0)
    >>> compiled_level(lin)
    0.0
    >>> uncompile(lin)
    >>> compiled_level(lin) is None
    True
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .types import Decision

#: The partitioner's activation budget of a compiled block under each decision.
LEVELS: dict[Decision, float] = {
    Decision.KEEP: 1.0,
    Decision.SELECTIVE: 0.5,
    Decision.RECOMPUTE: 0.0,
}


def _forward_of(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(self).forward(self, *args, **kwargs)


@functools.cache
def _level_function(budget: float) -> Callable[..., Any]:
    """The compiled forward of any block at ``budget``: a copy of :func:`_forward_of` with
    a code object of its own (torch.compile caches compiled frames per code object, so each
    level compiles its own graphs, shared by the blocks of one class and shape)."""
    code = _forward_of.__code__.replace(co_name=f"remat_block_at_{round(budget * 100)}")
    fn = types.FunctionType(code, _forward_of.__globals__, code.co_name)
    return torch.compile(fn)


class CompiledForward:
    """The instance-level ``forward`` of a block compiled at ``budget`` (holds it weakly)."""

    __slots__ = ("ref", "budget", "__weakref__")
    #: read by :func:`remat.explain` (a layer below the planner): the block is compiled
    remat_compiled = True

    def __init__(self, module: nn.Module, budget: float) -> None:
        self.ref = weakref.ref(module)
        self.budget = budget

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.ref()
        if module is None:
            raise RuntimeError("remat: the compiled block no longer exists.")
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.budget):
            return _level_function(self.budget)(module, *args, **kwargs)


def compile_block(module: nn.Module, budget: float) -> None:
    """Compile ``module``'s forward on its own with the partitioner's activation ``budget``
    (in ``[0, 1]``), in place: its hooks, parameters and ``state_dict`` stay as they are."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"compile_block: budget must be in [0, 1], got {budget!r}.")
    uncompile(module)
    module.__dict__["forward"] = CompiledForward(module, float(budget))


def uncompile(module: nn.Module) -> None:
    """Undo :func:`compile_block` (no-op where ``module`` is not compiled by it)."""
    if isinstance(module.__dict__.get("forward"), CompiledForward):
        del module.__dict__["forward"]


def compiled_level(module: nn.Module) -> float | None:
    """The budget ``module`` is compiled at by :func:`compile_block`, else ``None``."""
    fwd = module.__dict__.get("forward")
    return fwd.budget if isinstance(fwd, CompiledForward) else None


def check_compiled_decisions(decisions: Sequence[Decision], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` for a decision a compiled block does not take."""
    bad = [d.value for d in decisions if d not in LEVELS]
    if bad:
        raise ValueError(
            f"{where}: with compile=True the decisions are the partitioner's budgets "
            f"{ {d.value: b for d, b in LEVELS.items()} }; {bad} are not planned for "
            "compiled blocks: drop them from decisions."
        )




def refuse_process_group(where: str) -> None:
    """Raise ``ValueError`` naming ``where``: compiled plans under a process group (see the
    message) are not planned yet."""
    raise ValueError(
        f"{where}: compile=True under a process group is not planned yet: the allocator's "
        "events of a step include the communication threads' buffers, which vary from step "
        "to step (10 % on two FSDP2 ranks on CPU), so compiled plans are not predicted to the "
        "byte there. Plan one rank's compiled blocks without the group, or plan eager."
    )
