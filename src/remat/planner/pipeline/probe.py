"""One microbatch of a pipeline stage as a training step :func:`remat.profile` can measure.

A stage of ``torch.distributed.pipelining`` does not run a training step of its own: it
runs its module on a received activation (a leaf the schedule made requiring grad), and
its backward starts from a received gradient (``torch.autograd.backward(output,
grad_tensors=...)``), except on the last stage, which computes the loss. :class:`StageProbe`
is that work as a module whose step the profile measures:

* the input goes through :class:`Received`, which hands its gradient back to nobody: as in
  the stage, the input's gradient is computed (block 0's backward computes it) and, as the
  schedule moves it out of the leaf into its send, it is not part of the step's gradients;
* on stages before the last, :func:`injected` is the loss: a scalar whose backward hands
  the output the fixed gradient ``grad`` (the schedule's receive buffer, allocated once).
  The scalar and the seed ``loss.backward()`` allocates are the probe's own bytes
  (:data:`PROBE_LOSS_BYTES`, which the stage's step model takes back); on the last stage
  the loss is the schedule's ``loss_fn(output, target)``.

The profile's candidate blocks are the stage's (the probe's parameter names are the
stage's, under ``stage.``: :func:`stage_names` takes the prefix off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...engine.bytes import storage_bytes
from ...engine.tree import tensors_in
from ...memory import track

PREFIX = "stage."
"""What the probe adds before the stage's module names."""

PROBE_LOSS_BYTES = 8
"""What the probe's step holds on a stage before the last that the schedule's does not: its
scalar loss and the seed ``loss.backward()`` makes (float32, alive to backward's end)."""


class Received(torch.autograd.Function):
    """Identity in forward; in backward the input's gradient is computed and dropped (the
    schedule sends it away and keeps no copy among the step's gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        return None


class Injected(torch.autograd.Function):
    """A scalar loss whose backward hands ``out`` the gradient ``grad`` (not a copy)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.grad = grad
        return out.new_zeros(())

    @staticmethod
    def backward(ctx: Any, seed: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.grad, None


def injected(grad: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The loss of a stage before the last: its output receives ``grad`` in backward."""

    def loss(out: torch.Tensor) -> torch.Tensor:
        return Injected.apply(out, grad)  # type: ignore[no-any-return]

    return loss


class StageProbe(nn.Module):
    """The stage's module on a received input (see the module's docstring)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any) -> Any:
        args = tuple(
            Received.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
            for a in args
        )
        return self.stage(*args)


def stage_names(names: dict[str, Any]) -> dict[str, Any]:
    """``names`` (the probe's block names) with the stage's names as keys."""
    return {n.removeprefix(PREFIX): v for n, v in names.items()}


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``obj`` (tuples, lists, dicts)."""
    found: list[torch.Tensor] = []
    tensors_in(obj, found)
    return storage_bytes(found)


@dataclasses.dataclass(frozen=True)
class Forward:
    """What one microbatch's forward leaves alive until its backward, every block kept.

    Attributes:
        kept: all of it: saved tensors, the output, the loss (on the last stage).
        output: the output's bytes.
        loss: the loss's bytes (0 without ``loss_fn``).
    """

    kept: int
    output: int
    loss: int


def forward_bytes(
    probe: StageProbe, args: tuple[Any, ...], loss_fn: Callable[[Any], torch.Tensor] | None
) -> Forward:
    """Run one forward of ``probe`` (and ``loss_fn`` on its output, the last stage's) under a
    tracker: what it leaves alive."""
    with track() as t:
        out = probe(*args)
        loss = loss_fn(out) if loss_fn is not None else None
        measured = Forward(t.current_bytes, tensor_bytes(out), tensor_bytes(loss))
        del out, loss
    return measured
