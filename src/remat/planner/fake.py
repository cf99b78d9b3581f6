"""Profiles from shapes inside ``torch.autocast``: a fake twin of a real model.

Autocast casts the tensors of its device type (CPU, CUDA) and never meta ones, so a meta
twin's step inside an autocast region would be the full-precision step's. A *fake* twin
(torch's ``FakeTensorMode``: tensors that report the real device and carry its dispatch
keys, their storage on meta) goes through autocast's kernels as the real tensors do (the
casts, which autograd saves, and the cache of cast weights are the real step's) and then
through the meta kernels: nothing is allocated. Inside the same
:func:`~.meta.shapes_only` as a meta model, every storage is counted at its size, so a
profile of the fake twin in the caller's region has the byte terms of the real step's,
without running that step (where it does not fit, it could not run).

What a fake twin cannot stand for, and is profiled on the device instead
(:func:`check_fakeable` says so, :class:`~.shaped.ProfileSource` falls back):

* **CPU's recurrent kernels.** ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` run oneDNN's RNN on
  CPU, which saves a workspace the meta kernels do not have: the bytes would differ.
* **Shapes that depend on values**, as with a meta twin: the fake step raises.

Libraries may take fake tensors for a trace: transformers' ``is_tracing`` does, and skips
its checks of values there (which is what lets most of its models run fake), but BART then
builds a decoder mask its eager step leaves to the kernel: 8 KiB more in each decoder
block's input of the test config, predicted high (a plan on the safe side).

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 4)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> fake, fake_opt, mode = fake_twin(model, opt)
    >>> (x,), _ = on_fake(mode, ((torch.randn(2, 4),), {}))
    >>> with mode, torch.autocast("cpu", dtype=torch.bfloat16):
    ...     y = fake(x)
    >>> y.dtype, y.device.type, fake_mode_of(fake, ()) is mode
    (torch.bfloat16, 'cpu', True)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..engine.tree import replace_tensors, tensors_in
from .meta import copy_model

__all__ = ["check_fakeable", "fake_mode_of", "fake_steps", "fake_twin", "on_fake"]

#: Modules whose CPU kernels save other tensors than the meta kernels a fake step runs.
_CPU_ONLY_KERNELS = (nn.RNNBase,)


def fake_mode_of(model: nn.Module, args: Any) -> FakeTensorMode | None:
    """The fake tensor mode of the model's tensors (its first parameter, else its first
    input), or ``None`` when they are not fake."""
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    first = next(iter([*model.parameters(), *found]), None)
    return first.fake_mode if isinstance(first, FakeTensor) else None


def check_fakeable(model: nn.Module) -> None:
    """Raise ``TypeError`` where a fake twin's bytes would not be the model's (see the
    module docstring)."""
    for name, mod in model.named_modules():
        if isinstance(mod, _CPU_ONLY_KERNELS):
            where = next(iter(mod.parameters()), None)
            if where is None or where.device.type == "cpu":
                raise TypeError(
                    f"{name or 'the model'} ({type(mod).__name__}) runs CPU's own recurrent "
                    "kernel, which saves what no fake tensor shows"
                )


def fake_twin(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[nn.Module, torch.optim.Optimizer | None, FakeTensorMode]:
    """A fake copy of the model (same modules, hooks and wrapping; parameters and buffers
    fake tensors of their device) and of its optimizer, and the mode their steps run in.

    Raises ``TypeError`` for what cannot be copied so (a distributed model, a tensor
    subclass's parameters, :func:`check_fakeable`'s kernels).
    """
    check_fakeable(model)
    mode = FakeTensorMode(allow_non_fake_inputs=False)

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        f = mode.from_tensor(t.detach()).requires_grad_(t.requires_grad)
        return nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f

    fake, _, _, opt = copy_model(model, (), {}, optimizer, fake_of)
    return fake, opt, mode


def on_fake(mode: FakeTensorMode, args: Any) -> Any:
    """``args`` with each tensor a fake copy of it in ``mode`` (other leaves shared).

    Example:
        >>> import torch
        >>> (x, n), _ = on_fake(FakeTensorMode(), ((torch.randn(2, 4), 3), {}))
        >>> type(x).__name__, list(x.shape), n
        ('FakeTensor', [2, 4], 3)
    """
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    memo: dict[int, torch.Tensor] = {}
    for t in found:
        if id(t) not in memo:
            f = mode.from_tensor(t.detach())
            memo[id(t)] = f.requires_grad_(t.requires_grad) if t.is_leaf else f
    return replace_tensors(args, [memo[id(t)] for t in found], [0])


@contextlib.contextmanager
def fake_steps(mode: FakeTensorMode) -> Iterator[None]:
    """Inside, ``mode`` is on, and torch's log of a meta kernel that refused (the step then
    raises, and the model is profiled on its device) is quiet; put back on exit."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with mode:
            yield
    finally:
        logger.setLevel(level)
