"""``checkpoint_sequential``: checkpoint a chain of modules in segments."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .checkpoint import checkpoint


class _Run:
    """Runs ``functions[start:end]`` in order (a named class, not a closure)."""

    __slots__ = ("functions", "start", "end")

    def __init__(self, functions: Sequence[Callable[..., Any]], start: int, end: int) -> None:
        self.functions = functions
        self.start = start
        self.end = end

    def __call__(self, x: Any) -> Any:
        for j in range(self.start, self.end):
            x = self.functions[j](x)
        return x


def checkpoint_sequential(
    functions: torch.nn.Sequential | torch.nn.ModuleList | Sequence[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = False,
    **kwargs: Any,
) -> Any:
    """Run a chain of modules in ``segments`` chunks, checkpointing all but the last.

    The split is torch's: ``len(functions) // segments`` functions per chunk
    and the remainder in the last chunk, which runs without checkpointing
    because backward needs its activations at once.

    Args:
        functions: an ``nn.Sequential``, an ``nn.ModuleList`` or a sequence
            of callables, each taking the previous one's output.
        segments: number of chunks, from 1 to ``len(functions)``.
        input: the input of the first function.
        use_reentrant: as in :func:`checkpoint` (default ``False``).
        **kwargs: the other options of :func:`checkpoint`
            (``preserve_rng_state``, ``context_fn``, ``determinism_check``,
            ``debug``, ``early_stop``, ``respect_saved_tensors_hooks``).

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> remat.checkpoint_sequential(model, 2, x).sum().backward()
    """
    allowed = {
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
        "respect_saved_tensors_hooks",
    }
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(
            f"Unexpected keyword arguments: {','.join(unknown)}. checkpoint_sequential takes "
            f"the options of checkpoint: {sorted(allowed)}."
        )
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    elif isinstance(functions, torch.nn.ModuleList):  # indexable like a list, as torch allows
        functions = list(functions)
    elif not isinstance(functions, Sequence) or isinstance(functions, str):
        raise TypeError(
            "checkpoint_sequential: functions must be an nn.Sequential or a list of callables "
            f"(an nn.ModuleList works too), got {type(functions).__name__}."
        )
    n = len(functions)
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(
            f"checkpoint_sequential: segments must be an int, got {segments!r}. Pass the number "
            "of chunks to split 'functions' into."
        )
    if n == 0:
        raise ValueError("checkpoint_sequential: functions is empty; pass at least one callable.")
    if not 1 <= segments <= n:
        raise ValueError(
            f"checkpoint_sequential: segments must be between 1 and len(functions) = {n}, got "
            f"{segments}. Pass the number of chunks to split 'functions' into."
        )
    size = n // segments
    end = 0
    for start in range(0, size * (segments - 1), size):
        end = start + size
        input = checkpoint(
            _Run(functions, start, end), input, use_reentrant=use_reentrant, **kwargs
        )
    return _Run(functions, end, n)(input)
