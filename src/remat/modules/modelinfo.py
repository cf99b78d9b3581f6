"""What remat needs to know about a user's model, shared by the wrappers, ``verify`` and the planner.

* :func:`candidates`: the candidate blocks, by ``check_fn`` or by the default rule
  (:func:`remat.modules.blocks.default_blocks`); :func:`in_call_order`: them in the order one
  forward calls them;
* :func:`loss_of` / :func:`default_loss`: a scalar loss from the model's output;
* :func:`device_of` / :func:`counted_device`: where the model runs and whose bytes count;
* :class:`BufferSnapshot`: buffer values put back after steps that are not the user's;
* :func:`check_grad_enabled`: a clear error under ``no_grad``;
* :func:`rng_state` / :func:`set_rng_state` and :func:`graph_leaves`: steps that leave no trace.

Nothing here imports the planner or the wrappers: they import this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..engine.tree import tensors_in
from .blocks import default_blocks


def check_module(model: Any, where: str, arg: str = "model") -> None:
    """Raise a clear ``TypeError`` unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where}: {arg} must be a torch.nn.Module, got {type(model).__name__} "
            f"({model!r:.60}). Pass the model itself (for a function, wrap it in an nn.Module)."
        )


def candidates(
    model: nn.Module, check_fn: Callable[[str, nn.Module], bool] | None, where: str = "remat.profile"
) -> list[str]:
    """Names of the candidate blocks: those ``check_fn(name, module)`` selects (the outermost
    ones), else the repeated blocks of every stack (:func:`remat.modules.blocks.default_blocks`), in
    the order of the model's tree (:func:`in_call_order` puts them in the order forward
    calls them; :func:`remat.profile` records that order in its warm-up step)."""
    if check_fn is None:
        names = default_blocks(model)
    else:
        names = []
        for name, m in model.named_modules():
            if name and not any(name.startswith(p + ".") for p in names) and check_fn(name, m):
                names.append(name)
    if not names:
        raise ValueError(
            f"{where}: found no candidate blocks in {type(model).__name__} (it has no "
            "repeated submodules, nor an nn.ModuleList/nn.Sequential). Pass check_fn=lambda "
            "name, module: ... that selects the blocks to plan (for example its transformer "
            "layers)."
        )
    return names


def in_call_order(
    model: nn.Module,
    names: Sequence[str],
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> list[str]:
    """``names`` in the order one forward of ``model`` first calls them; those it does not
    call follow, in their given order.

    The planner models the blocks as a chain run in this order; the order of the module
    tree is not always it (a U-Net registered up stacks before down stacks, a model that
    builds its decoder before its encoder). The forward runs once without gradients, with
    a forward pre-hook on each block; buffers (BatchNorm statistics), the RNG state and
    inputs the forward changes in place are put back, so it is not one of the user's steps.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.b = torch.nn.Linear(2, 2)
        ...         self.a = torch.nn.Linear(2, 2)
        ...     def forward(self, x):
        ...         return self.b(self.a(x))
        >>> in_call_order(Net(), ["b", "a"], (torch.randn(1, 2),))
        ['a', 'b']
    """
    calls = _FirstCalls()
    handles = [model.get_submodule(n).register_forward_pre_hook(calls.hook(n)) for n in names]
    found: list[torch.Tensor] = []
    tensors_in((args, kwargs), found)
    copies = [(t, t._version, t.detach().clone()) for t in found if not t.requires_grad]
    devices = sorted({t.device.index or 0 for t in [*found, *model.parameters()] if t.is_cuda})
    buffers = BufferSnapshot(model)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model(*args, **(kwargs or {}))
    finally:
        for h in handles:
            h.remove()
        buffers.restore()
        with torch.no_grad():
            for t, version, copy in copies:
                if t._version != version:
                    t.copy_(copy)
    return [*calls.order, *(n for n in names if n not in calls.order)]


class _FirstCalls:
    """Forward pre-hooks that record the order of the blocks' first calls."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def hook(self, name: str) -> Callable[[nn.Module, Any], None]:
        return functools.partial(self.called, name)

    def called(self, name: str, module: nn.Module, args: Any) -> None:
        if name not in self.order:
            self.order.append(name)


def default_loss(out: Any, where: str = "remat.verify") -> torch.Tensor:
    """The loss the model returns, else the sum of the floating outputs that require grad
    (in float32).

    A model that computes its own loss (Hugging Face models given ``labels``) returns it as
    the ``loss`` entry (a mapping, such as ``ModelOutput``) or attribute of its output; the
    user's step is then ``model(**batch).loss.backward()``, and that is the step measured
    (summing the logits as well would add a gradient the size of the logits to it).
    """
    own = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if (
        isinstance(own, torch.Tensor)
        and own.dim() == 0
        and own.is_floating_point()
        and own.requires_grad
    ):
        return own
    tensors: list[torch.Tensor] = []
    tensors_in(out, tensors)
    floats = [t for t in tensors if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError(
            f"{where}: the model's output holds no floating tensor that requires grad (are all "
            "its parameters frozen, requires_grad=False, and no input requires grad?); there is "
            "no backward to run. Pass loss_fn=... that turns the output into a scalar loss "
            "that requires grad."
        )
    return sum((t.float().sum() for t in floats), torch.zeros((), device=floats[0].device))


def loss_of(
    out: Any, loss_fn: Callable[[Any], torch.Tensor] | None, where: str = "remat.profile"
) -> torch.Tensor:
    """``loss_fn(out)``, or :func:`default_loss` when none is given."""
    if loss_fn is not None:
        return loss_fn(out)
    return default_loss(out, where)


def check_grad_enabled(where: str) -> None:
    """Raise a clear error when called under ``torch.no_grad()`` / ``inference_mode()``."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            f"{where} was called with gradients disabled (inside torch.no_grad() or "
            "torch.inference_mode()); it runs training steps (forward and backward) to measure "
            f"them. Call it outside that block, or wrap the call in torch.enable_grad()."
        )


def device_of(model: nn.Module, args: Any) -> torch.device:
    """The device of the first tensor argument, else of the first parameter, else CPU."""
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    for t in [*found, *model.parameters()]:
        return t.device
    return torch.device("cpu")


def counted_device(device: torch.device) -> torch.device | None:
    """The device whose bytes the planner counts: the model's (host buffers of offload are
    not device memory there); everything (``None``) on CPU."""
    return None if device.type == "cpu" else device


class BufferSnapshot:
    """The values of a model's buffers (BatchNorm running statistics, counters), put back later.

    Steps that are not the user's (profiling, measuring) run the model in its
    current mode; in training mode they update running statistics, which must
    not count as the user's steps.
    """

    def __init__(self, model: nn.Module) -> None:
        self.saved: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
        for mod in model.modules():
            for name, buf in mod._buffers.items():
                if buf is None or nn.parameter.is_lazy(buf):
                    continue
                self.saved.append((mod._buffers, name, buf, buf.detach().clone()))

    def restore(self) -> None:
        with torch.no_grad():
            for store, name, buf, value in self.saved:
                buf.copy_(value)
                store[name] = buf  # a step that replaced the buffer gets the original back


def rng_state() -> tuple[Any, Any]:
    """The CPU RNG state and, when CUDA is already in use, every CUDA device's (for
    :func:`set_rng_state`); CUDA is never initialised here."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[Any, Any]) -> None:
    """Put back an RNG state taken by :func:`rng_state`."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def graph_leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors whose ``.grad`` a backward from ``root`` accumulates into."""
    leaves: list[torch.Tensor] = []
    seen: set[Any] = set()
    todo = [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            leaves.append(var)
        todo.extend(fn for fn, _ in node.next_functions)
    return leaves


def check_not_meta(model: nn.Module | None, args: Any, where: str, instead: str) -> None:
    """Raise ``ValueError`` when the model's parameters or buffers, or its tensor inputs, are
    on the meta device: a step there has no values and holds no bytes (torch would fail
    inside it, or every figure would read 0). ``instead``: what plans such a model.

    Example:
        >>> import torch
        >>> check_not_meta(torch.nn.Linear(2, 2), (torch.randn(1, 2),), "remat.verify", "")
    """
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    own = [*model.parameters(), *model.buffers()] if model is not None else []
    if not any(t.is_meta for t in [*own, *found]):
        return
    raise ValueError(
        f"{where}: the model or its inputs are on the meta device, where a step has no values "
        "and holds no bytes. Materialize the model first (model.to_empty(device=...), then "
        f"initialize its weights or load a checkpoint) with real inputs{instead}."
    )
