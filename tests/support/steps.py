"""One training step's loss and gradients, as the tests take them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def loss_of(out: Any) -> torch.Tensor:
    """The model's own loss (Hugging Face models given labels), else the output's sum: the
    loss remat.profile takes by default."""
    own = getattr(out, "loss", None)
    return own if isinstance(own, torch.Tensor) else out.float().sum()


def param_grads(model: nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the gradients of ``model``'s parameters, then of those of ``inputs`` that
    have one."""
    out = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return out + [x.grad.clone() for x in inputs if x.grad is not None]


def step_grads(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int = 0
) -> list[torch.Tensor]:
    """The parameters' gradients of one step from RNG seed ``seed`` (dropout draws the same
    masks) on :func:`loss_of`, copied; the model's gradients are ``None`` again after it."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_of(model(*args, **kwargs)).backward()
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return got
