"""Steps that are not the user's: what they change, put back exactly; bytes that exist before a step.

Profiling and measuring run real training steps. :class:`StepState` records
everything such a step changes (RNG, buffers, gradients of parameters and
inputs, optimizer state and hyper-parameters, parameter values when an
optimizer steps) and puts it back, on every exit path. :func:`static_bytes`
and :func:`grad_bytes` count the bytes a step starts with.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

# One count of storage bytes for the tracker, the planner and offload (sparse tensors by
# their parts, a wrapper subclass such as FSDP2's DTensor by its local shard).
from ..engine.bytes import storage_bytes
from ..engine.tree import tensors_in
from ..modules.modelinfo import BufferSnapshot
from .amp import fresh_region
from .sharded import bucket_bytes, bucket_view_params


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (``exp_avg``, ``momentum_buffer``, ``step``, ...)."""
    if optimizer is None:
        return []
    found: list[torch.Tensor] = []
    tensors_in(list(optimizer.state.values()), found)
    return found


def static_bytes(model: nn.Module, args: Any, device: torch.device | None) -> int:
    """Bytes of the model's parameters and buffers, of the tensor inputs and of DDP's
    gradient buckets (see :mod:`remat.planner.sharded`); a sharded parameter by its shard."""
    inputs: list[torch.Tensor] = []
    tensors_in(args, inputs)
    own = storage_bytes([*model.parameters(), *model.buffers(), *inputs], device)
    return own + bucket_bytes(model, device)


def trainable(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters whose ``.grad`` a step writes: the model's and the optimizer's."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    if optimizer is not None:
        for g in optimizer.param_groups:
            for p in g["params"]:
                params.setdefault(id(p), p)
    return list(params.values())


def grad_bytes(params: Iterable[torch.Tensor], device: torch.device | None) -> int:
    """Bytes of the ``.grad`` of ``params`` that exist now."""
    return storage_bytes([p.grad for p in params if p.grad is not None], device)


def check_step_options(where: str, optimizer: Any, set_to_none: Any) -> None:
    """Raise a clear ``TypeError`` for an ``optimizer`` or ``set_to_none`` a step cannot use."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: optimizer must be a torch.optim.Optimizer or None, got "
            f"{type(optimizer).__name__}. Pass the optimizer your training loop steps."
        )
    if not isinstance(set_to_none, bool):
        raise TypeError(
            f"{where}: set_to_none must be True or False (as in optimizer.zero_grad), "
            f"got {set_to_none!r}."
        )


class StepState:
    """Everything a training step changes, recorded now and put back by :meth:`restore`.

    The gradients of the parameters (and of the leaf inputs) are taken off
    (set to ``None``) and given back as the very tensors they were, so the
    steps in between never write into the user's gradients.

    Args:
        model: the model.
        inputs: the leaf tensors among the inputs that require grad.
        optimizer: also record its state, hyper-parameters and the parameter
            values (an ``optimizer.step()`` changes them).
        device: also record that device's RNG (CUDA).
        tensors: every tensor among the step's inputs: those that need no gradient
            (the data) are copied to host memory, and one the model changes in place
            (``x /= 255`` in ``forward``) is put back before each step and at the end,
            so every step sees the user's values and the user gets them back.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: list[torch.Tensor],
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        tensors: Sequence[torch.Tensor] = (),
    ) -> None:
        self.params = trainable(model, optimizer)
        views = bucket_view_params(model)
        #: the parameters whose gradients are their own bytes (not views of DDP's buckets)
        self.grad_params = [p for p in self.params if id(p) not in views]
        self.leaves = [*self.params, *[t for t in inputs if all(t is not p for p in self.params)]]
        self.grads = [t.grad for t in self.leaves]
        self.buffers = BufferSnapshot(model)
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
        self.optimizer = optimizer
        self.values: list[torch.Tensor] = []
        if optimizer is not None:
            self.opt_state = optimizer.state
            self.groups = [
                {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                for g in optimizer.param_groups
            ]
            self.opt_attrs = {k: v for k, v in vars(optimizer).items() if k == "_opt_called"}
            with torch.no_grad():  # in host memory: the device's is the steps'
                self.values = [
                    p.detach().clone() if p.is_meta else p.detach().to("cpu", copy=True)
                    for p in self.params
                ]
        for t in self.leaves:
            t.grad = None
        self.data: list[list[Any]] = []  # [tensor, version, host copy]
        seen: set[int] = set()
        with torch.no_grad():
            for t in tensors:
                if (
                    type(t) is torch.Tensor
                    and not t.requires_grad
                    and t.layout is torch.strided
                    and not t.is_meta
                    and id(t) not in seen
                ):
                    seen.add(id(t))
                    self.data.append([t, t._version, t.detach().to("cpu", copy=True)])

    def reset_rng(self) -> None:
        """Put the RNG, and any input the model changed in place, back where they were, for
        the next step."""
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        for entry in self.data:
            t, version, host = entry
            if t._version != version:
                with torch.no_grad():
                    t.copy_(host)
                entry[1] = t._version

    def fresh_optimizer_state(self) -> None:
        """Give the optimizer an empty state, as before its first step (restored later)."""
        if self.optimizer is not None:
            self.optimizer.state = collections.defaultdict(dict)

    def restore(self) -> None:
        """Put everything back as it was when this object was made."""
        opt = self.optimizer
        if opt is not None:
            opt.state = self.opt_state
            for group, saved in zip(opt.param_groups, self.groups):
                group.update(saved)
            for k in ("_opt_called",):
                vars(opt).pop(k, None)
            vars(opt).update(self.opt_attrs)
            with torch.no_grad():
                for p, v in zip(self.params, self.values):
                    if v is not p:
                        p.copy_(v)
        for t, grad in zip(self.leaves, self.grads):
            t.grad = grad
        self.buffers.restore()
        self.reset_rng()
        fresh_region()  # the caller's autocast region must not reuse casts of the steps
